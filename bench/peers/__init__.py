"""peers: a harness that loads carpool and other inference servers side by side.

Every target speaks carpool's client protocol (docs/protocol.md) on a ``tcp://127.0.0.1``
endpoint, so one open-loop load generator drives them all:

- :mod:`peers.mlp`: the benchmark model (an ONNX MLP, about 1 ms at batch 1, 3 ms at 16);
- :mod:`peers.greedy`: the floor, a one-process ROUTER that runs whatever has arrived;
- :mod:`peers.targets`: carpool with each policy, carpool at another revision, the floor;
- :mod:`peers.openloop`: the load generator, a process of its own.

``bench/policy_live.py`` runs them. The modules import their siblings as ``peers.*`` and
bench/common.py as ``common`` (bench/ is on ``sys.path``).
"""
