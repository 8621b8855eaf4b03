"""The decision core: shapes, features, acceptance and step-time estimates, the policy and the
step controller that drives one decode step.

Pure Python, NumPy and XGBoost: nothing here imports SGLang, the telemetry store or Prometheus.
The SGLang adapter (``sglang_adatree.sglang``) and the policy lab drive the same
``controller.StepController``; what a step produced leaves it through sinks the caller wires in.
"""
