"""The policy lab: replay exact acceptance traces under any load and step-time profile, and score
any policy, through the same step controller the server runs, against the oracles.

* ``traces``: what every shape would emit at every position of a request (``tracegen`` builds
  exact ones from a draft / target pair, over ``target_pass``, ``draft_forward`` and
  ``tree_replay``; ``parametric`` draws them from acceptance hazards);
* ``profiles``: what a decode step of each shape costs on a deployment (``hardware``: GPU
  rooflines; ``measured``: this CPU's served steps or a deployment's telemetry; ``passes``:
  how passes compose into a step, shared with ``scripts/gpu_step_profile.py``);
* ``simulator``: continuous batching as SGLang runs it, time advanced by a profile, each
  request's emitted tokens read from its trace;
* ``scenarios`` and ``commands``: ``adatree simulate``.
"""
