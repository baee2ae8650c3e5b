"""vLLM integration: the general plugin (``plugin``) and the compiled callable vLLM saves (``compiled``).

Nothing here imports vLLM at import time; ``plugin`` is loaded by vLLM's plugin loader in every
vLLM process (the ``vllm.general_plugins`` entry point) and by ``import capturepass`` (for
``capturepass.backend`` and ``capturepass.post_grad_pass``). See docs/vllm.md.
"""
