"""The gRPC service, its interceptors (TLS, rate limit) and the ``hlb place`` client."""
