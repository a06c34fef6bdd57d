"""How tests/server/test_kv_events.py's SGLANG_VECTORS were made: SGLang 0.5.23's own page-hash
functions (from the released wheel, unmodified) run on fixed tokens. Not run by the tests (SGLang is
not a dependency). To rerun:
    pip download sglang==0.5.23 --no-deps -d /tmp/eco_sgl && unzip the wheel into /tmp/eco_sgl/src
    g++ -O2 -std=c++17 -shared -fPIC -DTORCH_EXTENSION_NAME=hicache_hash_cpp -I<torch>/include \
        -I<python include> src/sglang/srt/mem_cache/cpp_utils/hash_binding.cpp \
        -o /tmp/eco_sgl/build/hicache_hash_cpp<EXT_SUFFIX> -lcrypto
    python tests/server/data/sglang_hash_vectors.py   # prints the JSON the test's table holds
get_hash_str / hash_str_to_int64 are taken from sglang/srt/mem_cache/utils.py by ast (that module's
imports pull GPU kernels); get_native_hash is native_hash.py loading the compiled hash_binding.cpp,
as its own loader does through torch's cpp_extension."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import sys
import typing
from pathlib import Path
from typing import Any

ROOT = "/tmp/eco_sgl"
SRC = f"{ROOT}/src/sglang/srt/mem_cache"
PAGE_SIZE = 4
FUNCTIONS = ("get_hash_str", "hash_str_to_int64")


def sglang_functions() -> tuple[Any, Any]:
    sys.path.insert(0, f"{ROOT}/build")
    import hicache_hash_cpp  # type: ignore[import-not-found]

    spec = importlib.util.spec_from_file_location("native_hash", f"{SRC}/cpp_utils/native_hash.py")
    assert spec is not None and spec.loader is not None
    native_hash = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native_hash)
    native_hash._load_native_hash_module = lambda: hicache_hash_cpp
    tree = ast.parse(Path(f"{SRC}/utils.py").read_text())
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in FUNCTIONS]
    names: dict[str, Any] = {name: getattr(typing, name) for name in ("Any", "List", "Optional")}  # as its source
    names.update(hashlib=hashlib, get_native_hash=native_hash.get_native_hash)
    exec(compile(ast.fix_missing_locations(ast.Module(body=wanted, type_ignores=[])), f"{SRC}/utils.py", "exec"), names)
    return names["get_hash_str"], names["hash_str_to_int64"]


def main() -> None:
    get_hash_str, hash_str_to_int64 = sglang_functions()
    trunk = [(i * 37 + 11) % 500 + 3 for i in range(40)]  # 10 pages from the root
    branch = trunk[:8] + [(i * 53 + 7) % 500 + 3 for i in range(8)]  # shares 2 pages, then 2 of its own
    out = {}
    for name, tokens in (("trunk", trunk), ("branch", branch)):
        digests = get_hash_str(tokens, None, page_size=PAGE_SIZE)  # SGLang chains the pages itself
        # node by node, as the radix tree calls it: a child's prior hash is its parent's last digest
        first = get_hash_str(tokens[:8], None, page_size=PAGE_SIZE)
        assert first + get_hash_str(tokens[8:], first[-1], page_size=PAGE_SIZE) == digests
        out[name] = {"tokens": tokens, "digests": digests, "block_hashes": [hash_str_to_int64(h) for h in digests]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
