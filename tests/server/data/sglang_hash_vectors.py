"""How tests/server/test_kv_events.py's SGLANG_VECTORS were made: SGLang 0.5.23's own page-hash
functions (from the released wheel, unmodified) run on fixed tokens. Not run by the tests (SGLang is
not a dependency). To rerun: `pip download sglang==0.5.23 --no-deps -d /tmp/eco_sgl`, unzip the wheel
into /tmp/eco_sgl/src, compile src/sglang/srt/mem_cache/cpp_utils/hash_binding.cpp into
/tmp/eco_sgl/build/hicache_hash_cpp*.so (g++ -O2 -std=c++17 -shared -fPIC
-DTORCH_EXTENSION_NAME=hicache_hash_cpp -I<torch>/include -I<python include> ... -lcrypto), then
run this file and compare its JSON with the test's table.

get_hash_str / hash_str_to_int64 are taken from sglang/srt/mem_cache/utils.py by ast (the module's
imports pull torch kernels); get_native_hash is native_hash.py, loading hash_binding.cpp compiled
with g++ against torch's pybind11 headers and -lcrypto (as its own loader does with cpp_extension)."""
import ast, hashlib, importlib.util, sys, json
from typing import Any, List, Optional
sys.path.insert(0, "/tmp/eco_sgl/build")
import hicache_hash_cpp
SRC = "/tmp/eco_sgl/src/sglang/srt/mem_cache"
spec = importlib.util.spec_from_file_location("native_hash", f"{SRC}/cpp_utils/native_hash.py")
native_hash = importlib.util.module_from_spec(spec); spec.loader.exec_module(native_hash)
native_hash._load_native_hash_module = lambda: hicache_hash_cpp
tree = ast.parse(open(f"{SRC}/utils.py").read())
wanted = {"get_hash_str", "hash_str_to_int64"}
mod = ast.Module(body=[n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted], type_ignores=[])
ns = {"hashlib": hashlib, "Any": Any, "List": List, "Optional": Optional, "get_native_hash": native_hash.get_native_hash}
exec(compile(ast.fix_missing_locations(mod), f"{SRC}/utils.py", "exec"), ns)
get_hash_str, hash_str_to_int64 = ns["get_hash_str"], ns["hash_str_to_int64"]

PAGE = 4
trunk = [(i * 37 + 11) % 500 + 3 for i in range(40)]       # 10 pages from the root
branch = trunk[:8] + [(i * 53 + 7) % 500 + 3 for i in range(8)]  # shares 2 pages, then 2 of its own
out = {}
for name, tokens in (("trunk", trunk), ("branch", branch)):
    hexes = get_hash_str(tokens, None, page_size=PAGE)      # one call: SGLang chains the pages itself
    # node by node as the radix tree would: first node 2 pages, its child the rest, prior = parent's last
    first = get_hash_str(tokens[:8], None, page_size=PAGE)
    rest = get_hash_str(tokens[8:], first[-1], page_size=PAGE)
    assert first + rest == hexes
    out[name] = {"tokens": tokens, "digests": hexes, "block_hashes": [hash_str_to_int64(h) for h in hexes]}
print(json.dumps(out))
