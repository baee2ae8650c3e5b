"""Runs a sweep's list of items in shards, each in a process of its own, all at once.

Used by ``scripts/arch_sweep.py --procs``. A child process prints one result line per item, in
its shard's order (lines that follow a result line without being one, a traceback, belong to
it). A child that ends before reporting all its items died on the first it did not report (a
native crash: a segmentation fault, an abort); a new child goes on with the rest.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from collections.abc import Callable


def run_shards(shards: list[list[str]], argv: Callable[[list[str]], list[str]], result: re.Pattern,
               drop: re.Pattern | None = None, seconds: float | None = None) -> dict[str, str]:
    """Runs every shard in a process of its own, all at once, and prints each item's result as
    its process reports it, whole (a failure with its traceback).

    Args:
        shards: the items of each process, in the order it runs them.
        argv: the command line of a process for some items.
        result: matches a result line; group 1 is its kind (``OK``, ``FAIL``...), group 2 the item.
        drop: matches lines of a child's own not to relay (its summary).
        seconds: after this long every process still running is killed (its process group: the
            compile workers it started go too), and the items not reported are left out.

    Returns:
        Each reported item's kind. An item a process died on is ``CRASH``, printed with the
        process's exit status.
    """
    kinds: dict[str, str] = {}
    lock = threading.Lock()
    live: set[subprocess.Popen] = set()
    expired = threading.Event()

    def emit(block: list[str]) -> None:
        with lock:
            head = result.match(block[0])
            if head:
                kinds[head.group(2)] = head.group(1).strip()
            print("".join(block), end="", flush=True)

    def expire() -> None:
        with lock:
            expired.set()
            for proc in live:
                os.killpg(proc.pid, signal.SIGKILL)

    def shard(items: list[str]) -> None:
        while items:
            with lock:
                if expired.is_set():
                    return
                proc = subprocess.Popen(argv(items), stdout=subprocess.PIPE, text=True, start_new_session=True)
                live.add(proc)
            block: list[str] = []
            for line in proc.stdout:
                if drop is not None and drop.match(line):
                    continue
                if result.match(line) and block:
                    emit(block)
                    block = []
                block.append(line)
            status = proc.wait()
            with lock:
                live.discard(proc)
            if block and not (expired.is_set() and not result.match(block[0])):
                emit(block)
            with lock:
                items = [m for m in items if m not in kinds]
            if items and not expired.is_set():
                emit([f"CRASH {items[0]}: its process ended with status {status} while on it\n"])
                items = items[1:]

    timer = threading.Timer(seconds, expire) if seconds is not None else None
    if timer is not None:
        timer.start()
    threads = [threading.Thread(target=shard, args=(list(s),)) for s in shards if s]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if timer is not None:
        timer.cancel()
    return kinds
