"""``torchrun`` whose stores listen only on the addresses the job names (issue 50):
``python -m helpers.engine.cluster.torchrun ARGS`` runs ``python -m torch.distributed.run ARGS``
with the agent's two ``TCPStore`` servers made by :func:`helpers.engine.processes.tcp_store`: the
c10d rendezvous store on ``--rdzv-endpoint``'s host, the workers' store on ``--local-addr``
(``--standalone``: ``localhost``, with ``--local-addr=127.0.0.1`` from
:func:`helpers.engine.cluster.agents.torchrun_command`). torch's own listen on every interface (``::``).
"""

import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend as c10d_backend
import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic
from torch.distributed import run

from helpers.engine.processes import tcp_store


def main(argv: list[str] | None = None) -> None:
    """torchrun's ``main`` on ``argv`` (default: ``sys.argv[1:]``), stores bound as above."""
    c10d_backend.TCPStore = tcp_store  # the name _create_tcp_store calls
    dynamic.DynamicRendezvousHandler._create_tcp_store_server = (
        lambda self, addr, port: tcp_store(addr, port, is_master=True, multi_tenant=True))
    run.main(argv)


if __name__ == "__main__":
    main()
