"""A fleet of replicas: how requests are dispatched among them (dispatch.py), and what the fleet's
KV memory looks like as one thing (duplicated prefixes, routing loss). Pure logic over telemetry
reads: `kvscope serve --dp-size N`, `kvscope replay --dp-size N`, `kvscope fleet` and the Fleet
page all take their figures from here."""
