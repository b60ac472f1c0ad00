"""``hlb bench``: benchmarks that print JSON; they may import every other part of hlb."""
