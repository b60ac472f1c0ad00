"""The bus: the seam hlb reads from and writes to, its in-memory twin, Kafka, and the codecs."""
