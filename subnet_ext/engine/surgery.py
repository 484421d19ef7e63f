"""Module surgery: turn the full model into this rank's subnetwork, in place.

Forward regime (`materialise_forward`): sliced tensors become compact (only the owned
rows/columns, in global order), skipped blocks are replaced by their shortcut path, so
the memory of what is not owned is released.

Backward regime (`prepare_backward`): the full tensors stay (the forward is the full
model) but stop being parameters; each owned piece becomes a Parameter that is a *view*
of its full tensor, so the optimizer updates the full tensor in place and keeps state
only for owned pieces. Linear layers compute the owned weight gradient with the masked
backward kernel; other layers (convs, norms) route the gradient through a
concatenation of detached and owned slices.
"""
from __future__ import annotations

import types
import weakref

import torch
import torch.nn as nn

from .. import ops
from ..ops.autocast import autocast_dtype, cast_to
from ..planning.pieces import Piece
from ..planning.residual import skip_path
from .head_check import check_sliced_heads
from .owned_conv import install_owned_conv
from .slicing import slice_group, split_name
from .width_keeping import keep_width


class SkippedBlock(nn.Module):
    """What a rank runs for a block it does not own: the block's skip path only.

    skip="identity": returns its input (transformer blocks, pre-LN, post-LN or parallel;
    residual MLP blocks; blocks with an identity shortcut and no ReLU after the sum).
    skip="shortcut" / "shortcut_relu": shortcut(x), or relu(shortcut(x)) for blocks that
    apply a ReLU after the residual sum; the shortcut is the skip path traced from the
    block (planning/residual.py), its modules kept (shared) under their own names, so a
    shape-changing block stays maskable and its checkpoint names do not move.

    x: the block's input [B, C, ...] (further arguments, e.g. masks, are ignored);
    returns the skip output (same shape as the block's output).
    """

    def __init__(self, block: nn.Module, skip: str):
        super().__init__()
        self.skip = skip
        self._skip_forward = None
        if skip != "identity":
            path = skip_path(block)
            if path.traced and path.mode != skip:
                raise ValueError(f"SkippedBlock: the plan says skip={skip!r} for a {type(block).__name__}, "
                                 f"but the block computes {path.mode!r}: the plan was made for another model")
            for name in path.modules:
                setattr(self, name, getattr(block, name))
            self._skip_forward = path.forward
        if isinstance(block, nn.TransformerEncoderLayer):
            # nn.TransformerEncoder reads layers[0].self_attn.batch_first before running.
            self._batch_first = types.SimpleNamespace(batch_first=block.self_attn.batch_first)
        self._fast_path_source = ()  # see stand_in_for_skipped_first_layers

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            source = self.__dict__.get("_fast_path_source")
            if source:
                return getattr(source[0], name)
            if name == "self_attn" and "_batch_first" in self.__dict__:
                return self.__dict__["_batch_first"]
            raise

    def forward(self, x, *args, **kwargs):
        """The skip path's output for x (the block's input; extra arguments ignored): x itself for
        skip="identity", else shortcut(x) or relu(shortcut(x)), shaped as the block's output."""
        if self._skip_forward is not None:
            return self._skip_forward(self, x)
        return x

    def extra_repr(self) -> str:
        """The skip mode, for repr()."""
        return f"skip={self.skip!r}"


def stand_in_for_skipped_first_layers(model: nn.Module) -> None:
    """nn.TransformerEncoder decides its nested-tensor fast path (eval with a padding mask)
    by reading layers[0]'s attention and norm weights. When a rank skips layer 0, the stub
    answers those reads with the first layer it does run, so the encoder decides exactly as
    the encoder made of this rank's layers would; the stub itself passes the (nested) input
    through. An encoder whose every layer is skipped takes the slow path."""
    for encoder in model.modules():
        if not isinstance(encoder, nn.TransformerEncoder) or not isinstance(encoder.layers[0], SkippedBlock):
            continue
        run = [layer for layer in encoder.layers if not isinstance(layer, SkippedBlock)]
        if run:
            encoder.layers[0].__dict__["_fast_path_source"] = (run[0],)
        else:
            encoder.use_nested_tensor = False


class _InverseScale:
    """Pre-hook scaling a consumer's input by full width / kept width (inverted dropout)."""

    def __init__(self, factor: float):
        self.factor = factor

    def __call__(self, module, args):
        return (args[0] * self.factor,) + tuple(args[1:])


def materialise_forward(model: nn.Module, plan, pieces: list[Piece], rank: int, scale: str) -> list:
    """Forward regime, in place. Returns the hook handles it installed (scale="inverse"). Head
    groups whose module cannot run sliced keep their width (width_keeping.py), recorded in
    plan.width_kept ({module path: why}) for plan.summary()."""
    if plan.level == "block":
        for g, (a, _) in zip(plan.groups, plan.unit_ranges):
            if not bool(plan.owners[rank, a]):
                path, leaf = split_name(g.path)
                parent = model.get_submodule(path)
                setattr(parent, leaf, SkippedBlock(parent.get_submodule(leaf), g.skip))
        stand_in_for_skipped_first_layers(model)
        return []
    # Before any surgery: a refusal leaves the model as it was. Groups that cannot run sliced keep their width.
    width_kept = check_sliced_heads(model, plan, pieces, rank)
    plan.width_kept.update(width_kept)
    handles = []
    for g, (a, b) in zip(plan.groups, plan.unit_ranges):
        kept = int(plan.owners[rank, a:b].sum())
        if g.path in width_kept:
            keep_width(model, "", g, pieces, rank)
        else:
            slice_group(model, "", g, pieces, rank, kept)
        if scale == "inverse":
            for c in g.consumers:
                handles.append(model.get_submodule(c).register_forward_pre_hook(_InverseScale(g.size / kept)))
    return handles


class DirectGradient:
    """Where the masked kernel writes one owned run's weight gradient: a view of the
    run's place in its communication bucket, which becomes the run's `.grad` (so it is
    never packed); `ready(piece)` tells the engine the gradient is final."""

    def __init__(self, param: nn.Parameter, view: torch.Tensor, piece: Piece, ready):
        self.param, self.view, self.piece, self.ready = param, view.view(param.shape), piece, ready

    def write(self, g2: torch.Tensor, x2: torch.Tensor, out_runs, in_runs, last_use: bool = True) -> None:
        """Add one use's weight gradient into the bucket view, by the masked linear's gradient
        formula on runs (`ops.masked_linear_grad_runs_`: strided views into the GEMM, no
        gather, no host sync); readiness is reported only after the last use of this
        forward (weight sharing).

        g2 [N, out] and x2 [N, in] are the layer's output gradient and input; out_runs /
        in_runs the run's [(start, length)] (the other empty: every column). Under autocast
        g2 and x2 are fp16/bf16 and the bucket fp32: the formula multiplies them with fp32
        output and accumulation, with no fp32 copy of g2 or x2."""
        grad = self.param.grad
        if grad is not None and grad.data_ptr() != self.view.data_ptr():
            self.view.copy_(grad)  # a gradient put there by someone else: keep accumulating onto it
        mixed = x2.dtype in (torch.float16, torch.bfloat16) and self.view.dtype == torch.float32
        if x2.dtype != self.view.dtype and not mixed:  # any other pairing: the bucket's dtype
            g2, x2 = g2.to(self.view.dtype), x2.to(self.view.dtype)
        ops.masked_linear_grad_runs_(self.view, None, g2, x2, out_runs, in_runs, accumulate=grad is not None)
        self.param.grad = self.view
        if last_use:
            self.ready(self.piece)


class _UseCount:
    """How many times one forward called a masked Linear (`uses`) and how many of those
    calls' backwards have run (`done`). Shared by the calls' autograd contexts and held
    by the module only weakly, so a graph dropped without a backward takes its count
    with it and the next forward starts a fresh one."""

    __slots__ = ("uses", "done", "__weakref__")

    def __init__(self):
        self.uses, self.done = 0, 0

    def backward_ran(self) -> bool:
        """Count one use's backward; True when it was the last (the gradient is final)."""
        self.done += 1
        if self.done < self.uses:
            return False
        self.done = 0  # a retained graph may be backpropagated again
        return True


def _use_count(module) -> _UseCount | None:
    """This forward's use count of `module` (grad mode only: no backward follows otherwise)."""
    if not torch.is_grad_enabled():
        return None
    ref = getattr(module, "_sdp_use_count", None)
    count = ref() if ref is not None else None
    if count is None or count.done > 0:  # none alive, or its backward began: a new forward
        count = _UseCount()
        module._sdp_use_count = weakref.ref(count)
    count.uses += 1
    return count


class _OwnedLinearFunction(torch.autograd.Function):
    """y = x W^T + b with the full W; backward gives dense grad_x but the weight (and
    bias) gradient only for the owned runs of rows or columns. Every gradient comes from
    the masked linear's formulas: the dense grad_x from `ops.masked_linear_backward`, the
    owned runs' weight and bias gradients from `ops.masked_linear_grad_runs_` (strided
    views into the GEMM: the owned indices are runs, so nothing is gathered); this
    Function only decides where each goes.

    `runs` [(start, length)] along `dim` (0: rows, 1: columns), in the order of `views`;
    `direct[i]` (a DirectGradient or None) sends run i's weight gradient straight into
    its communication bucket instead of returning it to autograd."""

    @staticmethod
    def forward(ctx, x, weight, bias, dim, runs, direct, n_weight_views, use_count, *views):
        # Under autocast run (and save) the operands in autocast's dtype, as nn.Linear does,
        # so the backward's operands share one dtype; autograd casts the gradients back.
        ctx.bias_is_param = bias is not None and bias.requires_grad  # before the cast (a non-leaf copy)
        dtype = autocast_dtype(weight)
        x, weight, bias = cast_to(x, dtype), cast_to(weight, dtype), cast_to(bias, dtype)
        ctx.save_for_backward(x, weight)
        ctx.dim, ctx.runs, ctx.direct, ctx.n_weight_views = dim, runs, direct, n_weight_views
        ctx.use_count = use_count
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        g2 = grad_y.reshape(-1, grad_y.shape[-1]).contiguous()
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        # views = weight runs, then (rows sliced with a sliced bias) one bias run each
        owned_bias = ctx.dim == 0 and len(ctx.needs_input_grad) > 8 + ctx.n_weight_views
        # A Linear called several times per forward (weight sharing) sums its uses' gradients
        # in the bucket; the bucket may be issued only after the last use's backward.
        last_use = ctx.use_count is None or ctx.use_count.backward_ran()
        grad_x = None
        if ctx.needs_input_grad[0]:
            gx = ops.masked_linear_backward(g2, x2, weight, dense_grad_input=True, output_mask=(True, False, False),
                                            check_indices=False)[0]
            grad_x = gx.reshape(x.shape)
        grads = []
        for d, run in zip(ctx.direct, ctx.runs):
            out_runs, in_runs = ([run], []) if ctx.dim == 0 else ([], [run])
            if d is not None:
                d.write(g2, x2, out_runs, in_runs, last_use)
                grads.append(None)
            else:
                gw = g2.new_empty((run[1], x2.shape[1]) if ctx.dim == 0 else (g2.shape[1], run[1]))
                ops.masked_linear_grad_runs_(gw, None, g2, x2, out_runs, in_runs)
                grads.append(gw)
        if owned_bias:
            for run in ctx.runs:
                gb = g2.new_empty(run[1])
                ops.masked_linear_grad_runs_(None, gb, g2, x2, [run])
                grads.append(gb)
        grad_bias = None
        if ctx.bias_is_param:  # an unsliced bias: every output's sum
            grad_bias = g2.new_empty(g2.shape[1])
            ops.masked_linear_grad_runs_(None, grad_bias, g2, x2)
        return (grad_x, None, grad_bias, None, None, None, None, None, *grads)


def _owned_linear_forward(module, x):
    weight_views = [getattr(module, n) for n in module._sdp_views["weight"]]
    bias_views = [getattr(module, n) for n in module._sdp_views.get("bias", [])]
    bias = module.bias_full if "bias" in module._sdp_views else module.bias
    return _OwnedLinearFunction.apply(x, module.weight_full, bias, module._sdp_dim, module._sdp_runs,
                                      module._sdp_direct, len(weight_views), _use_count(module),
                                      *weight_views, *bias_views)


class _AssembleOwned:
    """Pre-hook for non-linear layers: attr = full tensor with the owned slices swapped for
    their Parameters (same values), so autograd delivers gradient to the owned slices only."""

    def __init__(self, attrs):
        self.attrs = attrs  # attr -> (dim, [(start, length, view name)])

    def __call__(self, module, args):
        for attr, (dim, runs) in self.attrs.items():
            full = getattr(module, attr + "_full")
            parts, pos = [], 0
            for start, length, view in runs:
                if start > pos:
                    parts.append(full.narrow(dim, pos, start - pos))
                parts.append(getattr(module, view))
                pos = start + length
            if pos < full.shape[dim]:
                parts.append(full.narrow(dim, pos, full.shape[dim] - pos))
            object.__setattr__(module, attr, torch.cat(parts, dim))


def prepare_backward(model: nn.Module, plan, pieces: list[Piece], rank: int):
    """Backward regime, in place.

    Returns:
        piece_params: {piece: Parameter} for the owned sliced pieces (views of the full tensors).
        value_refs: {state-dict name: (module, attribute)} where each full tensor now lives.
        handles: the forward-pre-hook handles it installed (for SubnetDataParallel.close).
    """
    piece_params, value_refs, handles = {}, {}, []
    if plan.level == "block":
        for g, (a, _) in zip(plan.groups, plan.unit_ranges):
            if not bool(plan.owners[rank, a]):
                for n in g.params:
                    model.get_parameter(n).requires_grad_(False)
        return piece_params, value_refs, handles
    by_module = {}
    for p in pieces:
        if p.sliced and p.is_param:
            by_module.setdefault(split_name(p.name)[0], []).append(p)
    for path, mine in by_module.items():
        module = model.get_submodule(path)
        views, attrs = {}, {}
        for leaf in dict.fromkeys(split_name(p.name)[1] for p in mine):
            full = module._parameters.pop(leaf).detach().requires_grad_(False)
            module.register_buffer(leaf + "_full", full, persistent=False)
            object.__setattr__(module, leaf, full)  # code reading e.g. q_proj.weight.shape keeps working
            value_refs[f"{path}.{leaf}" if path else leaf] = (module, leaf + "_full")
            runs = []
            for i, p in enumerate(q for q in mine if split_name(q.name)[1] == leaf and rank in q.owners):
                view_name = f"{leaf}_owned{i}"
                param = nn.Parameter(full.narrow(p.dim, p.start, p.length))
                module.register_parameter(view_name, param)
                piece_params[p] = param
                runs.append((p.start, p.length, view_name))
            views[leaf] = [v for _, _, v in runs]
            attrs[leaf] = (next(p.dim for p in mine if split_name(p.name)[1] == leaf), runs)
        if isinstance(module, nn.Linear) and set(attrs) <= {"weight", "bias"} and "weight" in attrs:
            dim, runs = attrs["weight"]
            module._sdp_views, module._sdp_dim = views, dim
            module._sdp_runs = [(start, length) for start, length, _ in runs]
            module._sdp_direct = [None] * len(runs)  # set by the engine (attach_direct_gradients)
            if not runs:
                raise ValueError(f"rank {rank} owns no slice of {path!r} (backward regime needs at least one)")
            module.forward = types.MethodType(_owned_linear_forward, module)
        elif not install_owned_conv(module, attrs):
            handles.append(module.register_forward_pre_hook(_AssembleOwned(attrs)))
    return piece_params, value_refs, handles


def attach_direct_gradients(model: nn.Module, piece_params: dict, view_for, ready) -> int:
    """Backward regime: route the owned weight runs of masked Linear layers straight into
    their communication buckets. view_for(piece, numel) -> 1-D bucket view or None;
    ready(piece) is called once the run's gradient is written. Returns how many runs."""
    by_param = {id(param): piece for piece, param in piece_params.items()}
    count = 0
    for module in model.modules():
        if getattr(module, "_sdp_direct", None) is None:
            continue
        for i, name in enumerate(module._sdp_views["weight"]):
            param = getattr(module, name)
            piece = by_param.get(id(param))
            view = view_for(piece, param.numel()) if piece is not None else None
            if view is not None:
                module._sdp_direct[i] = DirectGradient(param, view, piece, ready)
                count += 1
    return count
