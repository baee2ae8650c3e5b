"""The pass pipeline: one module and one public class per pass.

Design note. The order is one literal list (``pipeline.PIPELINE``); each pass
names the IR properties it requires and ensures, and the pipeline is checked
when it is built; the named sub-pipelines (``FRONT``, ``ATEN``, ``ANALYSIS``)
are lists of it. The pass manager (``pipeline.run_pipeline``) runs them with
instruments (``instruments.py``) that time, log, verify and dump around every
pass; passes never print. ``INVARIANTS.md`` beside this file says
which pass may introduce what.
"""
