"""``capturepass show DIR``: what capturepass did, read back from a dump directory.

Prints, for every compiled graph under ``DIR`` (each a directory holding
``graph.json``), its owner, lanes and counts; the owners its callable created at
run time, per model instance (``owners.json``); then its decisions: the schedule's
time on one lane and on its lanes (measured where the folder holds a measured run,
estimated otherwise), every lane with its kernels and why they are on it (hinted,
placed by the scheduler, kept from their hint), every capability other than the
default with its reason and source, the decisions the passes recorded, and each
schedule measured at capture (``schedules.json``: every candidate's estimate against
its measured time, and the choice); the retained objects with their owner and segment; the external streams; every wait
with the dependency that made it necessary; every break with its reason.
``--json`` prints the same as one JSON object whose keys are ``lanes``,
``records``, ``waits``, ``leases``, ``retained``, ``segments``, ``breaks``
(totals over the graphs; ``lanes`` is the most any graph uses) and ``graphs``
(one object per graph: the counts, ``runtime_owners``, ``retained_objects``,
``wait_reasons``, ``timing`` and ``decisions``, each decision with its ``kind`` and the ``text``
the plain output prints). ``--html OUT`` also writes the schedule as a
self-contained HTML page (:mod:`capturepass.show.page`), ``--trace OUT`` as a
Chrome trace (:mod:`capturepass.show.trace`): with measured times for each graph whose folder holds
a ``measured.json`` of the same ``graph.json`` (written by
:func:`capturepass.trace` on a GPU), with the cost model's estimates otherwise; a
last line for each says where it went and which times it holds (on stderr with
``--json``).

A malformed dump (a ``graph.json`` that is not the document the printer writes, a
folder without one, a file given as the folder) prints one line naming the file and
the field at fault, and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from capturepass.errors import DumpError
from capturepass.show import page, trace
from capturepass.show.schedule import times_note
from capturepass.show.summary import format_summary, summarize


def main(argv: list[str] | None = None) -> int:
    """The ``capturepass`` console script."""
    parser = argparse.ArgumentParser(prog="capturepass", description="Inspect capturepass dumps.")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="summarize a dump directory")
    show.add_argument("dir", help="a dump directory (the dump_dir option, or one graph's folder in it)")
    show.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    show.add_argument("--html", metavar="OUT", help="also write the schedule as a self-contained HTML timeline")
    show.add_argument(
        "--trace", metavar="OUT",
        help="also write the schedule as a Chrome trace (Perfetto opens it): measured times where DIR holds a "
             "measured run (capturepass.trace), cost-model estimates otherwise",
    )
    args = parser.parse_args(argv)
    notes: list[str] = []
    try:
        summary = summarize(args.dir)
        if args.html or args.trace:
            if args.html:
                notes.append(f"page {args.html}: " + times_note(page.write_html(args.dir, args.html)))
            if args.trace:
                notes.append(f"trace {args.trace}: " + trace.trace_note(trace.write_trace(args.dir, args.trace)))
    except DumpError as exc:
        print(f"capturepass show: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # an output file (--html, --trace) that cannot be written
        print(f"capturepass show: {exc.filename or 'output'}: cannot be written ({exc.strerror or exc})",
              file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=1, sort_keys=True))
        for note in notes:  # stdout stays one JSON document
            print(note, file=sys.stderr)
    else:
        print(format_summary(summary))
        for note in notes:
            print(note)
    return 0
