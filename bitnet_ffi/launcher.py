"""One process per GPU, started from the CLI itself (``--tp N``), as torchrun would: ``run_ranks``
spawns the ranks, relays what rank 0 broadcasts (NCCL's unique id), collects each rank's result,
and turns a failure anywhere into an error everywhere. When a rank raises or dies, every other
rank is told which one (its RankContext aborts its communicators, so that no collective waits for
the dead rank, and ``check()`` raises RankFailedError naming it); the parent raises the same, with
each rank's message. A run past its timeout is aborted the same way. Nothing hangs: ranks still
alive a grace period after an abort are killed. A caller that runs ``run_ranks`` in a thread can
feed every rank the same commands meanwhile and take their replies (``generate --tp --chat``)."""
import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from multiprocessing.connection import wait

from .errors import RankFailedError

GRACE_S = 20.0
BLAME_WAIT_S = 2.0  # how long a failing rank waits to hear whether another rank failed first


class RankContext:
    """What a rank knows of the run: rank, world, its CUDA device, and the pipe to the launcher."""

    def __init__(self, rank, world, device, conn=None):
        self.rank, self.world, self.device = rank, world, device
        self.conn = conn
        self.aborted = threading.Event()
        self.abort_message, self.failed_rank = None, None
        self._callbacks = []
        self._inbox = queue.Queue()     # what rank 0 broadcasts
        self._commands = queue.Queue()  # what the launcher's caller sends (run_ranks' commands)
        if conn is not None:
            threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self):
        while True:
            try:
                kind, payload = self.conn.recv()
            except (EOFError, OSError):
                kind, payload = "abort", (None, "the launcher went away")
            if kind == "abort":
                self.failed_rank, self.abort_message = payload
                self.aborted.set()
                for callback in list(self._callbacks):
                    try:
                        callback()
                    except Exception:  # noqa: BLE001 - an abort must reach every communicator
                        pass
                return
            (self._commands if kind == "command" else self._inbox).put(payload)

    def on_abort(self, callback):
        """Calls callback() (from the listening thread) when another rank fails."""
        self._callbacks.append(callback)
        if self.aborted.is_set():
            callback()

    def check(self):
        if self.aborted.is_set():
            raise RankFailedError(f"rank {self.rank} stopped: {self.abort_message}",
                                  failed_rank=self.failed_rank)

    def broadcast(self, value=None):
        """Rank 0's value, on every rank (through the launcher)."""
        if self.world == 1:
            return value
        if self.rank == 0:
            self.conn.send(("broadcast", value))
            return value
        return self._next(self._inbox)

    def receive(self):
        """The next item of run_ranks' `commands` (the same on every rank, in order); None once
        the caller is done."""
        return self._next(self._commands)

    def reply(self, value):
        """Hands value to run_ranks' `replies` (in the caller's process)."""
        self.conn.send(("reply", value))

    def _next(self, inbox):
        while True:
            self.check()
            try:
                return inbox.get(timeout=0.2)
            except queue.Empty:
                continue


def _rank_main(target, rank, world, device, conn, args):
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    faulthandler.register(signal.SIGUSR1)  # the launcher asks for the stacks of a hung rank
    ctx = RankContext(rank, world, device, conn)
    try:
        result = target(ctx, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, then exit non-zero
        message = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, RankFailedError):
            failed = exc.failed_rank
        elif world > 1 and ctx.aborted.wait(BLAME_WAIT_S):
            # a peer's failure seen first as an error here (a collective cut short, say)
            failed = ctx.failed_rank
            message = f"RankFailedError: rank {rank} stopped: {ctx.abort_message} (here: {message})"
        else:
            failed = rank
        conn.send(("error", (failed, message, traceback.format_exc())))
        conn.close()
        os._exit(1)  # no atexit handlers: CUDA/NCCL teardown after a failure may block
    conn.send(("done", result))
    conn.close()


def run_ranks(target, world, args=(), timeout=600.0, devices=None, grace=GRACE_S, commands=None,
              replies=None):
    """Runs ``target(ctx, *args)`` in `world` spawned processes, rank r on CUDA device
    devices[r] (default r); returns their results in rank order. target and args must pickle.
    Raises RankFailedError naming the rank that failed first (or timed out); after a failure or
    the timeout, the other ranks get `grace` seconds to stop before they are killed.
    `commands` (a queue.Queue, for a caller that runs this in a thread): each item put there goes
    to every rank's ctx.receive(), None last; what a rank passes to ctx.reply() is put on
    `replies`."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    devices = list(range(world)) if devices is None else list(devices)
    context = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(world):
        parent, child = context.Pipe()
        proc = context.Process(target=_rank_main, args=(target, rank, world, devices[rank], child,
                                                        args), daemon=True)
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)
    results, errors, open_ranks = {}, {}, set(range(world))
    first_failure = None
    deadline = time.monotonic() + timeout
    send_lock = threading.Lock()  # the commands' thread sends too

    def send(ranks, message):
        with send_lock:
            for r in list(ranks):
                try:
                    pipes[r].send(message)
                except OSError:
                    pass

    def abort_all(failed_rank, message):
        send(open_ranks, ("abort", (failed_rank, message)))

    def relay_commands():
        while True:
            item = commands.get()
            send(open_ranks, ("command", item))
            if item is None:
                return

    if commands is not None:
        threading.Thread(target=relay_commands, daemon=True).start()

    try:
        while open_ranks:
            left = deadline - time.monotonic()
            if left <= 0:
                if first_failure is None:
                    first_failure = (None, f"timed out after {timeout:.0f} s (ranks "
                                           f"{sorted(open_ranks)} still running)")
                    abort_all(None, first_failure[1])
                    deadline = time.monotonic() + grace
                    continue
                break
            by_conn = {pipes[r]: r for r in open_ranks}
            by_sentinel = {procs[r].sentinel: r for r in open_ranks}
            for ready in wait(list(by_conn) + list(by_sentinel), timeout=min(left, 1.0)):
                rank = by_conn.get(ready, by_sentinel.get(ready))
                if rank not in open_ranks:
                    continue
                try:
                    kind, payload = pipes[rank].recv() if ready in by_conn else ("exit", None)
                except (EOFError, OSError):
                    kind, payload = "exit", None
                if kind == "broadcast":
                    send(open_ranks - {rank}, ("broadcast", payload))
                    continue
                if kind == "reply":
                    replies.put(payload)
                    continue
                open_ranks.discard(rank)
                if kind == "done":
                    results[rank] = payload
                    continue
                if kind == "error":
                    failed, message, trace = payload
                    errors[rank] = f"{message}\n{trace}"
                else:
                    procs[rank].join(1)
                    failed, message = rank, f"exited with code {procs[rank].exitcode}"
                    errors[rank] = message
                if first_failure is None:
                    failed = rank if failed is None else failed
                    first_failure = (failed, f"rank {failed} failed: {message}")
                    abort_all(failed, first_failure[1])
                    deadline = min(deadline, time.monotonic() + grace)
    finally:
        hung = [procs[r] for r in open_ranks if procs[r].is_alive()]
        for proc in hung:  # where each hung rank is stuck, on its stderr
            os.kill(proc.pid, signal.SIGUSR1)
        if hung:
            time.sleep(1.0)
        for proc in hung:
            proc.kill()
        for proc in procs:
            proc.join(5)
    if first_failure is None:
        return [results[r] for r in range(world)]
    failed, headline = first_failure
    lines = [headline] + [f"  rank {r}: {errors[r].splitlines()[0]}" for r in sorted(errors)]
    lines += [f"  rank {r}: killed after the grace period" for r in range(world)
              if r not in errors and r not in results]
    details = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
    raise RankFailedError("\n".join(lines) + ("\n" + details if details else ""), failed_rank=failed)
