"""The learned scorer: the GNN's features, its ONNX inference and the policy that uses it."""
