"""Every third-party header and Python module the project uses comes from a
package that tools/install-deps.sh installs.

A machine that once had a package installed by hand builds fine even when
install-deps.sh no longer lists it, so a green build proves nothing about a
fresh machine. This check asks Debian which package owns each header the
sources include and each module the Python code imports unconditionally, and
fails unless that package is listed or pulled in by a listed one (Depends and
Pre-Depends, recursively, as apt installs them without recommends).

  check_install_list.py --source-dir DIR [--compiler CXX] [--install-deps FILE]

Exit status: 0 when complete, 1 when something is missing from the list,
77 (CTest's skip) where there is no dpkg to ask.
"""

import argparse
import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig

SCANNED = ("include", "transports", "tests", "benchmarks", "tools", "examples", "python")
SOURCE_SUFFIXES = (".hpp", ".h", ".cpp", ".cc", ".cu", ".cuh", ".inl")
INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
CUDA_ROOT = "/usr/local/cuda"
SKIP = 77


def project_files(source_dir, suffixes):
    for top in SCANNED:
        for root, dirs, files in os.walk(os.path.join(source_dir, top)):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(files):
                if name.endswith(suffixes):
                    yield os.path.join(root, name)


def rel(path, source_dir):
    return os.path.relpath(path, source_dir)


# ---- headers -----------------------------------------------------------------

def compiler_search_path(compiler):
    """The compiler's own #include <...> folders, in its order."""
    run = subprocess.run([compiler, "-xc++", "-E", "-v", os.devnull], capture_output=True, text=True)
    lines = run.stderr.splitlines()
    try:
        start = lines.index("#include <...> search starts here:") + 1
        end = lines.index("End of search list.")
    except ValueError:
        return []
    return [line.strip() for line in lines[start:end]]


def mpi_search_path():
    wrapper = shutil.which("mpicxx")
    if not wrapper:
        return []
    run = subprocess.run([wrapper, "--showme:incdirs"], capture_output=True, text=True)
    return run.stdout.split() if run.returncode == 0 else []


def project_paths(source_dir):
    """Every file of ours, as paths relative to the source folder: an include
    that names the tail of one of them is ours (a test helper or a cuda-cpu
    test double reached through an include folder of the build)."""
    paths = set()
    for root, dirs, files in os.walk(source_dir):
        dirs[:] = [d for d in dirs if not d.startswith(".") and not d.startswith("build")]
        paths.update(rel(os.path.join(root, f), source_dir) for f in files)
    return paths


def is_ours(header, paths):
    return header in paths or any(p.endswith("/" + header) for p in paths)


def includes(source_dir):
    """{header: [files including it]} for the <...> and unresolved "..." includes."""
    found = {}
    for path in project_files(source_dir, SOURCE_SUFFIXES):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for kind, header in INCLUDE_RE.findall(text):
            if kind == '"' and in_project(header, os.path.dirname(path), source_dir):
                continue
            users = found.setdefault(header, [])
            if rel(path, source_dir) not in users:
                users.append(rel(path, source_dir))
    return found


def in_project(header, folder, source_dir):
    """Whether a quoted include names a file of ours: relative to the
    including file's folder or to one of its parents in the project."""
    while True:
        if os.path.isfile(os.path.join(folder, header)):
            return True
        if os.path.samefile(folder, source_dir):
            return False
        folder = os.path.dirname(folder)


def locate(header, folders):
    for folder in folders:
        candidate = os.path.join(folder, header)
        if os.path.isfile(candidate):
            return candidate
    return None


def classify_headers(found, system_path, own_paths):
    """Splits the headers into own, CUDA (the machine image's), to-check
    ({header: path}) and missing (on no include path)."""
    own, cuda, check, missing = [], {}, {}, []
    for header in sorted(found):
        if header.startswith("cpdispatch/"):
            own.append(header)
            continue
        system = locate(header, system_path)
        if system is None:
            if is_ours(header, own_paths):
                own.append(header)
            else:
                missing.append(header)
        elif os.path.realpath(system).startswith(os.path.realpath(CUDA_ROOT) + "/") or system.startswith(CUDA_ROOT + "/"):
            cuda[header] = system
        else:
            check[header] = system
    return own, cuda, check, missing


# ---- Python modules ------------------------------------------------------------

def guarded_by_import_error(handlers):
    names = set()
    for handler in handlers:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        names.update(k.id for k in kinds if isinstance(k, ast.Name))
    return bool(names & {"ImportError", "ModuleNotFoundError"})


def module_imports(tree):
    """(module, optional) for every import: optional when inside a try whose
    handler catches ImportError, or asked for with pytest.importorskip."""
    result = []

    def visit(node, optional):
        if isinstance(node, ast.Try):
            guarded = optional or guarded_by_import_error(node.handlers)
            for child in node.body:
                visit(child, guarded)
            for child in node.handlers + node.orelse + node.finalbody:
                visit(child, optional)
            return
        if isinstance(node, ast.Import):
            result.extend((a.name.split(".")[0], optional) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            result.append((node.module.split(".")[0], optional))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "importorskip" and node.args and isinstance(node.args[0], ast.Constant)):
            result.append((str(node.args[0].value).split(".")[0], True))
        for child in ast.iter_child_nodes(node):
            visit(child, optional)

    visit(tree, False)
    return result


def python_imports(source_dir):
    """{module: ([files importing it unconditionally], [files importing it optionally])},
    leaving out the project's own modules (the package and the scripts beside each file)."""
    found = {}
    for path in project_files(source_dir, (".py",)):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        here = os.path.dirname(path)
        for module, optional in module_imports(tree):
            if module == "cpdispatch" or module.startswith("_cpdispatch"):
                continue
            if os.path.exists(os.path.join(here, module + ".py")) or os.path.isdir(os.path.join(here, module)):
                continue
            users = found.setdefault(module, ([], []))[1 if optional else 0]
            if rel(path, source_dir) not in users:
                users.append(rel(path, source_dir))
    return found


def module_origin(module):
    """The file a module loads from, or None for built-in and absent ones."""
    if module in sys.builtin_module_names:
        return None
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return "absent"
    if spec.origin in (None, "built-in", "frozen"):
        locations = list(spec.submodule_search_locations or [])
        return locations[0] if locations else None
    return spec.origin


# ---- Debian -------------------------------------------------------------------

def owners(paths):
    """{path: package} from one dpkg -S call; the real path first (headers
    reached through /etc/alternatives are registered under their target),
    then the path as found."""
    tried = {}
    for path in paths:
        tried[path] = [os.path.realpath(path), path]
    queries = sorted({p for options in tried.values() for p in options})
    run = subprocess.run(["dpkg", "-S", *queries], capture_output=True, text=True)
    owner_of = {}
    for line in run.stdout.splitlines():
        if line.startswith("diversion ") or ": " not in line:
            continue
        packages, path = line.split(": ", 1)
        owner_of[path] = packages.split(",")[0].strip().split(":")[0]
    return {path: next((owner_of[p] for p in options if p in owner_of), None) for path, options in tried.items()}


def installed_packages():
    """{package: [dependency alternatives]} and {virtual name: [providers]} of what is installed."""
    run = subprocess.run(["dpkg-query", "-W", "-f=${Package}\t${db:Status-Abbrev}\t${Depends}\t${Pre-Depends}\t${Provides}\n"],
                         capture_output=True, text=True, check=True)
    depends, provides = {}, {}
    for line in run.stdout.splitlines():
        name, status, dep, predep, prov = (line.split("\t") + [""] * 5)[:5]
        if not status.startswith("ii"):
            continue
        groups = [g for g in (dep + "," + predep).split(",") if g.strip()]
        depends[name] = [[bare(alt) for alt in g.split("|")] for g in groups]
        for p in prov.split(","):
            if p.strip():
                provides.setdefault(bare(p), []).append(name)
    return depends, provides


def bare(item):
    """'libfoo:any (>= 1.2)' -> 'libfoo'."""
    return item.strip().split(" ")[0].split(":")[0]


def closure(roots, depends, provides):
    """Every installed package the roots pull in; an alternative or a virtual
    name counts whichever installed packages satisfy it."""
    seen, todo = set(), [r for r in roots if r in depends]
    while todo:
        package = todo.pop()
        if package in seen:
            continue
        seen.add(package)
        for group in depends.get(package, []):
            for name in group:
                for satisfier in ([name] if name in depends else []) + provides.get(name, []):
                    if satisfier not in seen:
                        todo.append(satisfier)
    return seen


def puller(package, depends, provides):
    """The installed package nobody depends on that pulls `package` in: the
    name to add to the list (libboost-dev for libboost1.74-dev)."""
    users = {}
    for name, groups in depends.items():
        for group in groups:
            for dep in group:
                for target in [dep] + provides.get(dep, []):
                    users.setdefault(target, set()).add(name)
    current, seen = package, {package}
    while True:
        above = sorted(users.get(current, set()) - seen)
        if not above:
            return current
        current = above[0] if len(above) == 1 else min(above, key=lambda n: (len(users.get(n, ())), n))
        seen.add(current)
        if len(seen) > 8:  # a long chain: the package itself is the clearer advice
            return package


def listed_packages(install_deps):
    run = subprocess.run(["bash", install_deps, "--list"], capture_output=True, text=True, check=True)
    return run.stdout.split()


# ---- the check ------------------------------------------------------------------

def check(args):
    if not shutil.which("dpkg") or not shutil.which("dpkg-query"):
        print("SKIPPED: no dpkg on this system, so the owners of headers and modules cannot be asked")
        return SKIP
    source_dir = os.path.realpath(args.source_dir)
    install_deps = args.install_deps or os.path.join(source_dir, "tools", "install-deps.sh")
    listed = listed_packages(install_deps)
    depends, provides = installed_packages()
    problems = [f"{p} is listed in {rel(install_deps, source_dir)} but not installed: run it" for p in listed if p not in depends]
    pulled = closure(listed, depends, provides)

    found = includes(source_dir)
    system_path = compiler_search_path(args.compiler) + mpi_search_path() + [
        sysconfig.get_paths()["include"], os.path.join(CUDA_ROOT, "include")]
    own, cuda, to_check, missing = classify_headers(found, system_path, project_paths(source_dir))
    for header in missing:
        problems.append(f"<{header}> (included by {', '.join(found[header][:3])}) is on no include path here: "
                        f"no installed package provides it, so {rel(install_deps, source_dir)} lacks the one that does")

    modules = python_imports(source_dir)
    origins = {m: module_origin(m) for m in sorted(modules)}
    optional = {m: files for m, (hard, files) in modules.items() if not hard}
    for module, origin in origins.items():
        if origin == "absent" and modules[module][0] and module.replace("_", "-") in required_names(source_dir):
            print(f"  Python module {module}: not installed for {sys.executable}; tools/python-env.sh installs it ({REQUIREMENTS})")
        elif origin == "absent" and modules[module][0]:
            problems.append(f"Python module '{module}' (imported by {', '.join(modules[module][0][:3])}) is not installed "
                            f"for {sys.executable}, so {rel(install_deps, source_dir)} lacks the package that provides it")

    venv_modules = from_python_env(source_dir, {m: o for m, o in origins.items() if modules[m][0]})
    files = dict(to_check)
    files.update({f"module {m}": o for m, o in origins.items() if o not in (None, "absent") and modules[m][0] and m not in venv_modules})
    owner_of = owners(sorted(set(files.values())))
    report = []
    for what, path in sorted(files.items()):
        users = found[what] if not what.startswith("module ") else modules[what[7:]][0]
        label = f"<{what}>" if not what.startswith("module ") else f"Python {what}"
        owner = owner_of.get(path)
        if owner is None:
            if is_standard_python(path):
                continue
            problems.append(f"{label} ({path}, used by {', '.join(users[:3])}) belongs to no Debian package: "
                            "it was installed by hand, so a fresh machine lacks it")
        elif owner not in pulled:
            problems.append(f"{label} (used by {', '.join(users[:3])}) comes from {owner}, which "
                            f"{rel(install_deps, source_dir)} neither lists nor pulls in: add {puller(owner, depends, provides)}")
        elif not is_standard_python(path):
            report.append(f"  {label}: {owner}")

    print(f"install list ({len(listed)} packages, {len(pulled)} with what they pull in): "
          f"{len(found)} headers included ({len(own)} ours, {len(cuda)} from {CUDA_ROOT}, {len(to_check)} checked), "
          f"{len(modules)} Python modules imported")
    for line in report:
        print(line)
    for header, path in sorted(cuda.items()):
        print(f"  <{header}>: the CUDA install ({path}), provided by the machine image, not by Debian")
    for module, dist in sorted(venv_modules.items()):
        print(f"  Python module {module}: {dist} from {REQUIREMENTS} (tools/python-env.sh)")
    for module, users in sorted(optional.items()):
        print(f"  Python module {module}: optional (imported under ImportError or importorskip by {', '.join(users[:3])})")
    for problem in problems:
        print(f"MISSING: {problem}")
    return 1 if problems else 0


REQUIREMENTS = "python/requirements.txt"


def requirement_name(requirement):
    return re.split(r"[\s<>=!~;\[]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def required_names(source_dir):
    """The distributions python/requirements.txt names."""
    requirements = os.path.join(source_dir, REQUIREMENTS)
    if not os.path.exists(requirements):
        return set()
    with open(requirements, encoding="utf-8") as f:
        return {requirement_name(line) for line in f if line.strip() and not line.lstrip().startswith("#")}


def from_python_env(source_dir, origins):
    """{module: distribution} of the imported modules that the project's
    Python environment installs: this interpreter is a virtual environment,
    the module lies in its site-packages, and its distribution is named in
    python/requirements.txt or required by one that is (what tools/python-env.sh
    installs with pip)."""
    import importlib.metadata as metadata

    if sys.prefix == sys.base_prefix:
        return {}
    todo = list(required_names(source_dir))
    wanted = set()
    while todo:
        dist = todo.pop()
        if dist in wanted:
            continue
        wanted.add(dist)
        try:
            todo += [requirement_name(r) for r in metadata.requires(dist) or [] if "extra ==" not in r]
        except metadata.PackageNotFoundError:
            pass
    site = os.path.realpath(sysconfig.get_paths()["purelib"])
    owners_of = metadata.packages_distributions()
    found = {}
    for module, origin in origins.items():
        if origin in (None, "absent") or not os.path.realpath(origin).startswith(site + "/"):
            continue
        dists = [d.lower().replace("_", "-") for d in owners_of.get(module.split(".")[0], [])]
        hit = next((d for d in dists if d in wanted), None)
        if hit:
            found[module] = hit
    return found


def is_standard_python(path):
    """A module of the interpreter's own standard library (not every
    interpreter is Debian's)."""
    std = os.path.realpath(sysconfig.get_paths()["stdlib"])
    return os.path.realpath(path).startswith(std + "/")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source-dir", required=True)
    parser.add_argument("--compiler", default="c++")
    parser.add_argument("--install-deps")
    sys.exit(check(parser.parse_args()))


if __name__ == "__main__":
    main()
