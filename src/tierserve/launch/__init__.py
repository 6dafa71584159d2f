"""``tierserve up``: a whole local cluster in one command. Starts ``mooncake_master`` (the shared
L3), N prefill and M decode nodes and the router as child processes, shows their logs prefixed by
name, waits until the router is ready, prints each child's role, ports, metrics URL and PID (and
keeps them in ``--state-file``), restarts a child that dies, and stops everything on Ctrl-C,
SIGTERM or a crash loop.

- ``plan``: what to start (``ClusterPlan``, ``RestartPolicy``, one ``ChildSpec`` per child).
- ``process``: the child processes (``Child``, ``Cluster``). ``supervisor``: restarts.
- ``state``: the banner's table and the state file. ``run``: ``up`` itself. ``probes``: readiness.
"""

from tierserve.launch.plan import ChildRole, ChildSpec, ClusterPlan, Ports, RestartPolicy, l3_flags, stages
from tierserve.launch.probes import free_port, grpc_serving, http_ok, tcp_open
from tierserve.launch.process import Child, Cluster
from tierserve.launch.run import up

__all__ = ["Child", "ChildRole", "ChildSpec", "Cluster", "ClusterPlan", "Ports", "RestartPolicy", "free_port",
           "grpc_serving", "http_ok", "l3_flags", "stages", "tcp_open", "up"]
