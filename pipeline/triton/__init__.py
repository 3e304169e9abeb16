"""Scaling out with Triton Inference Server: the model repository writer (repository), the model.py of its Python
backend form (python_model) and a real tritonserver for the tests (server)."""
