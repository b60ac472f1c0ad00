"""The GNN in PyTorch: model, training, ONNX export and parity checks (the ``export`` extra).

The only package that imports torch.
"""
