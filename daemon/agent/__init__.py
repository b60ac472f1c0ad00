"""``hlb agent`` on a real host: the host's devices, their metrics and the tasks they run, read from
NVML, DCGM exporter or node_exporter and published to Kafka as hlb's telemetry (docs/agents.md).

A *source* reads the host (``hlb.daemon.agent.readings.Source``): NVML through ``nvidia-ml-py``
(``hlb.daemon.agent.nvml``), DCGM exporter's and node_exporter's Prometheus text endpoints
(``hlb.daemon.agent.dcgm``, ``hlb.daemon.agent.node``, parsed with ``prometheus_client``'s parser). Units are
converted in the sources, so the daemon's contract stays strict: utilization a fraction, memory
in GiB, power in W. ``hlb.daemon.agent.models`` maps vendor model names to the device catalogue, and
``hlb.daemon.agent.host`` turns readings into inventory, metrics and ``HostTasks`` events.
"""
