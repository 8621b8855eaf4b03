"""``adatree bench``: adatree against the baselines on real SGLang servers.

Modules, in the order data flows:

* ``workloads``: prompt sets (MT-bench, GSM8K, HumanEval, JSONL) and the transition workload;
* ``configurations``: each compared policy as the server command a user would run;
* ``servers``: start one server, wait until healthy, stop it and all its children;
* ``client``: the load generator (Poisson arrivals or fixed concurrency) over streaming HTTP;
* ``steps``: per-step telemetry (shapes chosen, acceptance) of adatree-served policies;
* ``runner``: the loop over configurations, workloads and loads;
* ``results``: rows per (policy, workload, load) and the comparisons with the baselines;
* ``charts`` / ``report``: Plotly figures, the terminal table, JSON rows and the HTML report;
* ``commands``: the ``adatree bench`` command line.

Vocabulary as everywhere in the project: goodput is emitted (output) tokens per second of wall
time; acceptance length is emitted tokens per request per verify step.
"""
