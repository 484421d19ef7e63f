"""Planning: which rank owns which part of the model, decided from the model's structure alone."""
