"""The pass pipeline: one module and one public class per pass.

Design note. The order is one literal list (``pipeline.PIPELINE``); each pass
names the IR properties it requires and ensures, and the pipeline is checked
when it is built. One observer (``observer.py``) times, dumps and verifies
around every pass; passes never print. ``INVARIANTS.md`` beside this file says
which pass may introduce what.
"""
