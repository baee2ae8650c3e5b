"""``capturepass show``: reading what capturepass did back from its dumps.

The face of the dumps, in layers: ``dumps`` finds each compiled graph's folder and
reads its ``graph.json`` through the IR's validating reader; ``schedule`` replays
and times a graph's schedule (estimated, or measured where ``capturepass.trace``
recorded a run); ``summary`` is what the command prints (and ``--json`` holds);
``page`` draws the schedule as a self-contained HTML page and ``trace`` as a
Chrome trace; ``cli`` is the console script.
"""

from capturepass.show.summary import format_summary, summarize, summarize_dir

__all__ = ["format_summary", "summarize", "summarize_dir"]
