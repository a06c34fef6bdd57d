"""`kvscope serve`: an OpenAI-compatible HTTP front and a scheduler process, as SGLang lays them out.

protocol.py     the msgspec messages between the two processes (ZMQ)
scheduler.py    the scheduler process: the engine's one scheduler code path, fed over ZMQ
kv_events.py    SGLang's KV-event stream (BlockStored / BlockRemoved / AllBlocksCleared)
front.py        the HTTP front: OpenAI endpoints, SGLang's native ones, auth and principals, tokenizer manager
sglang_native.py  SGLang's /generate: its request fields and reply shapes (SGLang 0.5.23)
router.py       the data-parallel router (--dp-size N): each rank's loads and held pages, the rank per choice
api_keys.py     the --api-keys file both serve and load read
chat.py         the deterministic chat template (messages to text)
metrics.py      /metrics in Prometheus text format, with SGLang's metric names
load.py         `kvscope load`: a traffic generator on the official openai client
"""
