"""The moment every rank of a run is ready for its first round: the load phase is over everywhere,
and every rank sees the same run folder.

**Load phase under the long wait.** Building the world -- corpus scan, model build, checkpoint
load (a 9B decoder's ``from_pretrained`` or its shard), the run checkpoint of a resume -- takes
each rank its own time. The first collective after it used to run on the dead-peer group
(``run.timeout_s``), so ranks that finished loading more than that apart aborted a healthy job.
:func:`check_start` first waits for every rank on the slow group (``run.wait_timeout_s``): a rank
that loads late is waited for; a rank that dies while loading still fails the job at once (gloo
and NCCL see the closed connection, not the timeout).

**Shared run folder.** Rank 0 writes the folder (config, checkpoints, ledger); every rank reads
it on resume. A node that cannot see it would restart at round 1 while the others resume, and the
secure sum would then mix rounds or hang. So rank 0 writes a token drawn at this start into the
folder, every rank must read it back (retrying a few seconds for network file systems' attribute
caches), and every rank must have found the same checkpoint round; otherwise the run stops with
one line naming the folder and the host of the rank that does not see it.
"""

from __future__ import annotations

import secrets
import socket
import time
from pathlib import Path

from cluster_fl.distributed import Comm
from cluster_fl.engine.rundir import atomic_write_bytes
from cluster_fl.errors import UserError

TOKEN_NAME = "start.token"
READ_WITHIN_S = 10.0  # how long a rank retries before it declares the folder unseen


def check_start(comm: Comm, folder: Path, checkpoint_round: int) -> None:
    """Collective, after the world is built and the run checkpoint read, before the first round:
    wait for every rank's load phase (slow group), then check that every rank sees rank 0's run
    folder and resumes from the same round. Raises :class:`~cluster_fl.errors.UserError` (one
    line, the same on every rank) otherwise. One process: nothing to check."""
    if comm.world_size == 1:
        return
    comm.barrier(slow=True)  # the load phase is over on every rank
    token = None
    if comm.rank == 0:
        token = secrets.token_hex(16)
        atomic_write_bytes(Path(folder) / TOKEN_NAME, token.encode())
    token = comm.broadcast_object(token)
    seen = _read_token(Path(folder) / TOKEN_NAME, token)
    reports = comm.all_gather_object((seen, socket.gethostname(), str(folder), checkpoint_round),
                                     slow=True)
    _verdict(reports)


def _read_token(path: Path, token: str) -> str | None:
    """None when ``path`` holds ``token``, else why not (after retrying :data:`READ_WITHIN_S`,
    read at the call)."""
    deadline = time.monotonic() + READ_WITHIN_S
    delay = 0.05
    while True:
        try:
            found = path.read_text()
            if found == token:
                return None
            why = "it holds another start's token (a different folder of the same name?)"
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
        if time.monotonic() >= deadline:
            return why
        time.sleep(delay)
        delay = min(2 * delay, 1.0)


def _verdict(reports: list[tuple[str | None, str, str, int]]) -> None:
    """Every rank's (why it cannot read the token or None, host, folder, checkpoint round)."""
    _, host0, folder0, round0 = reports[0]
    for rank, (why, host, folder, _) in enumerate(reports):
        if why is not None:
            where = "" if folder == folder0 else f" (its run folder is {folder})"
            raise UserError(f"run folder {folder0} is not shared: rank {rank} on host {host} "
                            f"cannot read the start token that rank 0 on host {host0} wrote "
                            f"there{where}: {why}; put run.out on a file system every node "
                            "mounts")
    for rank, (_, host, _, round_) in enumerate(reports):
        if round_ != round0:
            raise UserError(f"run folder {folder0}: rank {rank} on host {host} found the "
                            f"checkpoint of round {round_}, rank 0 on host {host0} that of round "
                            f"{round0}; the ranks must resume from one checkpoint (a stale "
                            "network file system cache?)")
