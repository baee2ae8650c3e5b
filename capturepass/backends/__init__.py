"""Entry points: the torch.compile backend and the inner compilers of regions.

Design note. ``dynamo.py`` is the ``capturepass`` backend (registered through
the ``torch_dynamo_backends`` entry-point group) built on AOT autograd;
``inner.py`` compiles each region with Inductor, eager, or Torch-TensorRT;
``vllm/`` is the vLLM integration (the general plugin, the backend and pass routes, and
the compiled callable vLLM's AOT compile saves).
"""
