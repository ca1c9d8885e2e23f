"""Device-test shim, installed as ``sitecustomize`` by tools/device-extras.sh; not part of cute_mxfp8.

torchtitan 0.3.0 imports a few names that torch 2.11 (the H200's) lacks; only its parallelism helpers use them.
With TT_TORCH_SHIM=1, every ``from torch... import name`` in torchtitan's sources that torch cannot satisfy gets a
placeholder class, and the list is printed."""
import os
if os.environ.get("TT_TORCH_SHIM"):
    import ast, importlib, pathlib, sys, types
    _root = pathlib.Path(__file__).with_name("torchtitan")
    _missing = []
    for _f in _root.rglob("*.py"):
        try:
            _tree = ast.parse(_f.read_text())
        except Exception:
            continue
        for _n in ast.walk(_tree):
            if not (isinstance(_n, ast.ImportFrom) and _n.level == 0 and _n.module
                    and _n.module.split(".")[0] == "torch"):
                continue
            try:
                _mod = importlib.import_module(_n.module)
            except Exception:
                _mod = types.ModuleType(_n.module)
                sys.modules[_n.module] = _mod
                _missing.append(_n.module + ".*")
            for _a in _n.names:
                if _a.name == "*" or hasattr(_mod, _a.name):
                    continue
                try:
                    importlib.import_module(_n.module + "." + _a.name)
                    continue
                except Exception:
                    pass
                setattr(_mod, _a.name, type(_a.name, (), {}))
                _missing.append(_n.module + "." + _a.name)
    print("torch shim for torchtitan:", sorted(set(_missing)), file=sys.stderr)
