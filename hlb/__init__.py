"""hlb, a holistic load balancer for heterogeneous AI infrastructure: the one import name it installs.

The source keeps the folders the product's layout names, and this package gathers them under one
name: ``hlb.daemon`` (``daemon/``, the running service), ``hlb.sim`` (``sim/``, the digital twin),
``hlb.export`` (``export/``, the GNN in PyTorch), ``hlb.bench`` (``bench/``, benchmarks) and
``hlb.v1`` (``proto/hlb/v1``, the wire contracts). In the source tree these are links to those
folders; an installed wheel holds them as ordinary packages (``pyproject.toml``'s package-dir).
Imports go one way, ``cli -> bench -> export -> sim -> daemon -> v1`` (``make test`` checks it).
"""
