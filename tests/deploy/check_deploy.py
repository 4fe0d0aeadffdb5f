#!/usr/bin/env python3
"""Checks the deployment files (deploy/, dashboards/) against each other and against the real binaries.

    tests/deploy/check_deploy.py --repo REPO --bin BINDIR

BINDIR holds namm-coordinator, namm-worker and namm-api. What is checked:

- every YAML file under deploy/ and dashboards/provisioning/ parses (several documents per file allowed);
- the Grafana dashboards parse, every panel and query uses the ${datasource} variable, the run/datasource
  variables exist (run: training dashboards), and every metric named by a dashboard or the alert rules is one of
  docs/observability.md or docs/serving.md;
- promtool check config / check rules / test rules (skipped, saying so, only when promtool is not installed);
- systemd units: [Unit]/[Service]/[Install], ExecStart on a binary of BINDIR, systemd-analyze verify on a copy
  that points at BINDIR;
- Dockerfiles: ENTRYPOINT is /usr/local/bin/<binary of BINDIR> and the file builds and copies that binary;
- Kubernetes manifests: required fields, selectors, references between objects, probes, scrape annotations;
- every flag passed to namm-coordinator / namm-worker / namm-api (unit ExecStart and env examples, Dockerfile CMD, compose
  command, Kubernetes command/args) appears in `BINDIR/<binary> <subcommand> --help`, and every `serve` speaks TLS
  (--tls-cert / --tls-ca, never --insecure-plaintext).

Prints one line per check and exits 1, naming the file and the problem, when anything fails.
Needs Python 3 and PyYAML (python3-yaml) only.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

import yaml

BINARIES = ("namm-coordinator", "namm-worker", "namm-api")
# Programs without subcommands: their flags follow the binary.
NO_SUBCOMMAND = ("namm-api",)
INSTALL_DIR = "/usr/local/bin/"


class Report:
    def __init__(self):
        self.problems = []
        self.passed = 0

    def ok(self, what):
        self.passed += 1
        print(f"ok    {what}")

    def skip(self, what):
        print(f"SKIP  {what}")

    def fail(self, path, message):
        self.problems.append(f"{path}: {message}")
        print(f"FAIL  {path}: {message}")

    def mark(self):
        """A point to ask clean() about: were there no failures since?"""
        return len(self.problems)

    def clean(self, mark):
        return len(self.problems) == mark

    def check(self, condition, path, message):
        if not condition:
            self.fail(path, message)
        return bool(condition)


class Checker:
    def __init__(self, repo, bindir):
        self.repo = os.path.abspath(repo)
        self.bindir = os.path.abspath(bindir)
        self.r = Report()
        self.yaml_docs = {}  # relative path -> list of documents
        self.help_cache = {}

    # ---- helpers -------------------------------------------------------------------------------------------------

    def rel(self, path):
        return os.path.relpath(path, self.repo)

    def path(self, *parts):
        return os.path.join(self.repo, *parts)

    def files_under(self, top, suffixes):
        out = []
        root = self.path(top)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                if name.endswith(suffixes):
                    out.append(os.path.join(dirpath, name))
        return out

    def binary_options(self, binary, subcommand):
        """The long options of `binary subcommand --help` (`binary --help` when subcommand is None), or None when
        that is not a subcommand."""
        key = (binary, subcommand)
        if key not in self.help_cache:
            exe = os.path.join(self.bindir, binary)
            try:
                proc = subprocess.run([exe] + ([subcommand] if subcommand else []) + ["--help"], capture_output=True,
                                      text=True, timeout=60)
            except OSError as e:
                self.help_cache[key] = None
                self.r.fail(exe, f"cannot run: {e}")
                return None
            # CLI11 answers --help of an unknown subcommand with the program's own help: insist on its usage line.
            usage = re.search(r"^Usage: \S+ (\S+)", proc.stdout, re.M)
            if subcommand is None:
                self.help_cache[key] = set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", proc.stdout)) \
                    if proc.returncode == 0 else None
            elif proc.returncode != 0 or not usage or usage.group(1) != subcommand:
                self.help_cache[key] = None
            else:
                self.help_cache[key] = set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", proc.stdout))
        return self.help_cache[key]

    def check_invocation(self, where, binary, args):
        """args: what follows the binary (subcommand first). Checks the subcommand and every --flag."""
        if binary not in BINARIES:
            self.r.fail(where, f"runs '{binary}', which is not one of {', '.join(BINARIES)}")
            return
        if binary in NO_SUBCOMMAND:
            args = [None] + list(args)
        elif not args:
            self.r.fail(where, f"{binary} without a subcommand")
            return
        sub = args[0]
        shown = binary if sub is None else f"{binary} {sub}"
        options = self.binary_options(binary, sub)
        if options is None:
            self.r.fail(where, f"'{binary} {sub}' is not a subcommand of {os.path.join(self.bindir, binary)}")
            return
        flags = [a.split("=", 1)[0] for a in args[1:] if a.startswith("--")]
        # Every daemon the deployment files start speaks TLS: plaintext is never a template's default.
        if sub == "serve" or binary in NO_SUBCOMMAND:
            needed = "--tls-ca" if binary == "namm-worker" else "--tls-cert"
            self.r.check(needed in flags and "--insecure-plaintext" not in flags, where,
                         f"'{shown}' without TLS ({needed}) or with --insecure-plaintext")
        unknown = [f for f in flags if f not in options]
        for f in unknown:
            self.r.fail(where, f"flag {f} is not an option of '{shown}' ({os.path.join(self.bindir, shown)} "
                               f"--help does not list it)")
        if not unknown:
            self.r.ok(f"{where}: {shown}: {len(flags)} flags exist ({' '.join(flags)})")

    # ---- YAML ----------------------------------------------------------------------------------------------------

    def check_yaml_parses(self):
        files = self.files_under("deploy", (".yml", ".yaml")) + \
            self.files_under(os.path.join("dashboards", "provisioning"), (".yml", ".yaml"))
        if not files:
            self.r.fail("deploy/", "no YAML files found")
        for f in files:
            try:
                with open(f, encoding="utf-8") as fh:
                    docs = [d for d in yaml.safe_load_all(fh) if d is not None]
            except (yaml.YAMLError, UnicodeDecodeError) as e:
                self.r.fail(self.rel(f), f"does not parse as YAML: {e}")
                continue
            if not docs:
                self.r.fail(self.rel(f), "holds no YAML document")
                continue
            self.yaml_docs[self.rel(f)] = docs
            self.r.ok(f"{self.rel(f)}: parses ({len(docs)} document{'s' if len(docs) > 1 else ''})")

    def docs(self, rel):
        if rel not in self.yaml_docs:
            self.r.fail(rel, "missing or unparsable")
            return []
        return self.yaml_docs[rel]

    # ---- metric names --------------------------------------------------------------------------------------------

    def documented_metrics(self):
        names = {"up"}
        text = ""
        for rel in ("docs/observability.md", "docs/serving.md"):  # the training's metrics, and namm-api's
            try:
                text += open(self.path(*rel.split("/")), encoding="utf-8").read()
            except OSError as e:
                self.r.fail(rel, f"cannot read: {e}")
                return names
        for name, kind in re.findall(r"^\|\s*`(namm_[a-z0-9_]+)`\s*\|\s*(\w+)\s*\|", text, re.M):
            if kind == "histogram":
                names.update({name + "_bucket", name + "_sum", name + "_count"})
            else:
                names.add(name)
        if len(names) < 10:
            self.r.fail("docs/observability.md", "found no metric table")
        return names

    @staticmethod
    def promql_metric_names(expr):
        """Metric names a PromQL expression selects (strings, label matchers, ranges and grouping removed)."""
        e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
        e = re.sub(r"\{[^}]*\}", " ", e)
        e = re.sub(r"\[[^\]]*\]", " ", e)
        e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
        keywords = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                    "offset", "inf", "nan", "atan2"}
        names = set()
        for m in re.finditer(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", e):
            word, call = m.group(1), m.group(2)
            if call or word.lower() in keywords:
                continue
            names.add(word)
        return names

    def check_metric_names(self, where, exprs, documented):
        used = set()
        for expr in exprs:
            used |= self.promql_metric_names(expr)
        unknown = sorted(used - documented)
        for name in unknown:
            self.r.fail(where, f"uses metric '{name}', which neither docs/observability.md nor docs/serving.md defines")
        if not unknown:
            self.r.ok(f"{where}: all {len(used)} metric names are documented")
        return used

    # ---- dashboard -----------------------------------------------------------------------------------------------

    def check_dashboard(self, documented):
        dashboards = self.files_under("dashboards", (".json",))
        if not self.r.check(bool(dashboards), "dashboards/", "no dashboard JSON"):
            return
        for f in dashboards:
            rel = self.rel(f)
            try:
                d = json.load(open(f, encoding="utf-8"))
            except (ValueError, OSError) as e:
                self.r.fail(rel, f"does not parse as JSON: {e}")
                continue
            variables = {v.get("name"): v for v in d.get("templating", {}).get("list", [])}
            ds = variables.get("datasource")
            self.r.check(ds is not None and ds.get("type") == "datasource" and ds.get("query") == "prometheus", rel,
                         "needs a template variable 'datasource' of type datasource, query prometheus")
            # A training dashboard filters on the run; namm-api's (its metrics carry no run) on the server.
            serving = "namm_api_info" in json.dumps(d.get("templating", {}))
            run = variables.get("run")
            self.r.check(serving or (run is not None and "label_values(namm_run_info, run)" in json.dumps(run.get("query"))),
                         rel, "needs a template variable 'run' with query label_values(namm_run_info, run)")
            exprs = []
            for v in variables.values():
                if v.get("type") != "query":
                    continue
                if not self.is_ds_ref(v.get("datasource")):
                    self.r.fail(rel, f"variable '{v.get('name')}' does not query ${{datasource}}")
                q = v.get("query")
                q = q.get("query", "") if isinstance(q, dict) else (q or "")
                m = re.fullmatch(r"\s*label_values\(\s*(.*?)\s*,\s*\w+\s*\)\s*", q)
                exprs.append(m.group(1) if m else q)
            panels = list(self.walk_panels(d.get("panels", [])))
            ids = [p.get("id") for p in panels]
            self.r.check(len(ids) == len(set(ids)), rel, "panel ids are not unique")
            bad = 0
            queries = 0
            for p in panels:
                title = p.get("title", "?")
                if p.get("type") == "row":
                    continue
                if not self.is_ds_ref(p.get("datasource")):
                    self.r.fail(rel, f"panel '{title}' does not use the datasource ${{datasource}}")
                    bad += 1
                targets = p.get("targets") or []
                if not targets:
                    self.r.fail(rel, f"panel '{title}' has no query")
                    bad += 1
                for t in targets:
                    queries += 1
                    if "datasource" in t and not self.is_ds_ref(t["datasource"]):
                        self.r.fail(rel, f"a query of panel '{title}' does not use ${{datasource}}")
                        bad += 1
                    if not t.get("expr", "").strip():
                        self.r.fail(rel, f"a query of panel '{title}' has no expr")
                        bad += 1
                    else:
                        exprs.append(t["expr"])
                        coordinator = re.search(r"namm_(?!worker|api)", t["expr"]) is not None
                        if coordinator and '$run' not in t["expr"]:
                            self.r.fail(rel, f"panel '{title}': coordinator query without run=\"$run\": {t['expr']}")
                            bad += 1
            if not bad:
                self.r.ok(f"{rel}: {len(panels)} panels, {queries} queries, all on ${{datasource}}")
            self.check_metric_names(rel, exprs, documented)

    @staticmethod
    def is_ds_ref(ds):
        if isinstance(ds, str):
            return ds in ("${datasource}", "$datasource")
        return isinstance(ds, dict) and ds.get("uid") in ("${datasource}", "$datasource")

    def walk_panels(self, panels):
        for p in panels:
            yield p
            yield from self.walk_panels(p.get("panels", []))

    # ---- Grafana provisioning ------------------------------------------------------------------------------------

    def check_provisioning(self):
        for rel in ("dashboards/provisioning/datasources/prometheus.yaml",):
            for doc in self.docs(rel):
                sources = doc.get("datasources") or []
                prom = [s for s in sources if s.get("type") == "prometheus" and s.get("url")]
                self.r.check(doc.get("apiVersion") == 1 and prom, rel, "needs apiVersion 1 and a prometheus data source "
                                                                      "with a url")
                if prom:
                    self.r.ok(f"{rel}: Prometheus data source at {prom[0]['url']}")
        for rel in ("dashboards/provisioning/dashboards/namm.yaml",):
            for doc in self.docs(rel):
                providers = doc.get("providers") or []
                paths = [p.get("options", {}).get("path") for p in providers if p.get("type") == "file"]
                if self.r.check(doc.get("apiVersion") == 1 and any(paths), rel,
                                "needs apiVersion 1 and a file provider with options.path"):
                    self.r.ok(f"{rel}: dashboards from {paths[0]}")

    # ---- Prometheus ----------------------------------------------------------------------------------------------

    def check_prometheus(self, documented):
        prom_dir = os.path.join("deploy", "prometheus")
        configs = [os.path.join(prom_dir, n) for n in ("prometheus.yml", "prometheus-kubernetes.yml")]
        rules = os.path.join(prom_dir, "alerts.yml")
        tests = os.path.join(prom_dir, "alerts_test.yml")
        for rel in configs:
            for doc in self.docs(rel):
                jobs = {j.get("job_name") for j in doc.get("scrape_configs", [])}
                missing = {"namm-coordinator", "namm-worker"} - jobs
                if self.r.check(not missing, rel, f"lacks the scrape jobs {sorted(missing)} that alerts.yml matches"):
                    self.r.ok(f"{rel}: jobs namm-coordinator and namm-worker")
                self.r.check("alerts.yml" in (doc.get("rule_files") or []), rel, "does not load alerts.yml")
        exprs = []
        for doc in self.docs(rules):
            for group in doc.get("groups", []):
                for rule in group.get("rules", []):
                    name = rule.get("alert") or rule.get("record")
                    exprs.append(str(rule.get("expr", "")))
                    if rule.get("alert"):
                        self.r.check("severity" in (rule.get("labels") or {}), rules, f"{name}: no severity label")
                        ann = rule.get("annotations") or {}
                        self.r.check("summary" in ann and "description" in ann, rules,
                                     f"{name}: needs summary and description annotations")
                        self.r.check("for" in rule, rules, f"{name}: no 'for'")
        alerts = {rule.get("alert") for doc in self.docs(rules) for g in doc.get("groups", [])
                  for rule in g.get("rules", [])}
        wanted = {"NammRunStalled", "NammNoWorkers", "NammHighErrorRate", "NammFitnessNaN", "NammWorkerDown",
                  "NammCoordinatorDown"}
        if self.r.check(wanted <= alerts, rules, f"lacks the alerts {sorted(wanted - alerts)}"):
            self.r.ok(f"{rules}: {len(exprs)} rules, each with severity, summary, description and for")
        self.check_metric_names(rules, exprs, documented)

        promtool = shutil.which("promtool")
        if promtool is None:
            self.r.skip("promtool is not installed (Debian package 'prometheus'): promtool check config, check "
                        "rules and test rules not run")
            return
        for rel in configs:
            self.run_promtool(promtool, ["check", "config", rel], rel)
        self.run_promtool(promtool, ["check", "rules", rules], rules)
        self.run_promtool(promtool, ["test", "rules", tests], tests)

    def run_promtool(self, promtool, args, rel):
        proc = subprocess.run([promtool] + args, cwd=self.repo, capture_output=True, text=True, timeout=120)
        out = (proc.stdout + proc.stderr).strip()
        if proc.returncode == 0:
            self.r.ok(f"promtool {' '.join(args)}")
            return
        # Debian builds Prometheus without Kubernetes service discovery: its promtool does not know
        # kubernetes_sd_configs. Check everything else of such a file with the discovery swapped for static targets.
        if args[:2] == ["check", "config"] and "field kubernetes_sd_configs not found" in out:
            config = self.docs(rel)[0]
            with tempfile.TemporaryDirectory() as tmp:
                copy = json.loads(json.dumps(config))
                for job in copy.get("scrape_configs", []):
                    if job.pop("kubernetes_sd_configs", None) is not None:
                        job["static_configs"] = [{"targets": ["discovered.invalid:9100"]}]
                copy["rule_files"] = [self.path(os.path.dirname(rel), f) for f in copy.get("rule_files", [])]
                path = os.path.join(tmp, os.path.basename(rel))
                with open(path, "w") as fh:
                    yaml.safe_dump(copy, fh)
                proc = subprocess.run([promtool, "check", "config", path], capture_output=True, text=True,
                                      timeout=120)
            if proc.returncode == 0:
                self.r.ok(f"promtool check config {rel} (this promtool has no Kubernetes discovery: checked with "
                          f"kubernetes_sd_configs replaced by static targets)")
            else:
                self.r.fail(rel, "promtool check config failed (kubernetes_sd_configs replaced by static targets):\n"
                            + (proc.stdout + proc.stderr).strip())
            return
        self.r.fail(rel, f"promtool {' '.join(args)} failed:\n{out}")

    # ---- systemd -------------------------------------------------------------------------------------------------

    @staticmethod
    def parse_unit(text):
        """{section: [(key, value)]} with continuation lines joined."""
        sections = {}
        current = None
        pending = ""
        for raw in text.splitlines():
            line = pending + raw.strip() if pending else raw.strip()
            pending = ""
            if not line or line[0] in "#;":
                continue
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            if line.startswith("[") and line.endswith("]"):
                current = line[1:-1]
                sections.setdefault(current, [])
                continue
            if "=" in line and current is not None:
                k, v = line.split("=", 1)
                sections[current].append((k.strip(), v.strip()))
        return sections

    @staticmethod
    def parse_env(path):
        env = {}
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                line = line.strip()
                if not line or line.startswith("#") or "=" not in line:
                    continue
                k, v = line.split("=", 1)
                env[k.strip()] = v.strip().strip('"')
        return env

    def check_systemd(self):
        units = self.files_under(os.path.join("deploy", "systemd"), (".service",))
        if not self.r.check(bool(units), "deploy/systemd/", "no .service files"):
            return
        analyze = shutil.which("systemd-analyze")
        with tempfile.TemporaryDirectory() as tmp:
            for f in units:
                rel = self.rel(f)
                text = open(f, encoding="utf-8").read()
                sections = self.parse_unit(text)
                missing = [s for s in ("Unit", "Service", "Install") if s not in sections]
                if not self.r.check(not missing, rel, f"lacks the sections {missing}"):
                    continue
                service = sections["Service"]
                starts = [v for k, v in service if k == "ExecStart"]
                if not self.r.check(len(starts) == 1, rel, "needs exactly one ExecStart"):
                    continue
                argv = shlex.split(starts[0])
                exe = argv[0].lstrip("-@:+!")
                binary = os.path.basename(exe)
                if not self.r.check(exe.startswith(INSTALL_DIR) and os.access(os.path.join(self.bindir, binary),
                                                                             os.X_OK),
                                    rel, f"ExecStart runs {exe}, not {INSTALL_DIR}<a binary of {self.bindir}>"):
                    continue
                self.r.ok(f"{rel}: [Unit] [Service] [Install], ExecStart={exe}")
                # Expand $VAR / ${VAR} from the example env files that stand for its EnvironmentFile=s.
                env = {}
                for k, v in service:
                    if k != "EnvironmentFile":
                        continue
                    example = os.path.join(os.path.dirname(f),
                                           os.path.basename(v.lstrip("-")).replace("%i", "0") + ".example")
                    if self.r.check(os.path.exists(example), rel,
                                    f"EnvironmentFile {v} has no example {self.rel(example)} beside the unit"):
                        env.update(self.parse_env(example))
                args = []
                for a in argv[1:]:
                    whole = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", a)
                    if whole:  # $VAR: split on whitespace
                        args.extend(env.get(whole.group(1), "").split())
                        self.r.check(whole.group(1) in env, rel, f"ExecStart uses ${whole.group(1)}, which no "
                                                                 "example env file defines")
                        continue
                    for var in re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", a):
                        self.r.check(var in env, rel, f"ExecStart uses ${{{var}}}, which no example env file defines")
                    args.append(a)
                self.check_invocation(rel, binary, args)
                # systemd-analyze verify on a copy whose ExecStart points at BINDIR (the real path need not exist).
                if analyze is None:
                    continue
                name = os.path.basename(f)
                copy = os.path.join(tmp, name)
                with open(copy, "w") as fh:
                    fh.write(text.replace(INSTALL_DIR + binary, os.path.join(self.bindir, binary)))
                target = os.path.join(tmp, name.replace("@.", "@0.")) if "@." in name else copy
                proc = subprocess.run([analyze, "verify", target], cwd=tmp, capture_output=True, text=True,
                                      timeout=120)
                out = (proc.stdout + proc.stderr).strip()
                if proc.returncode == 0 and name not in out and "@0." not in out:
                    self.r.ok(f"systemd-analyze verify {rel} (ExecStart pointed at {self.bindir})")
                else:
                    self.r.fail(rel, f"systemd-analyze verify: {out or 'exit status %d' % proc.returncode}")
        if analyze is None:
            self.r.skip("systemd-analyze is not installed: units checked by parsing only")

    # ---- Dockerfiles ---------------------------------------------------------------------------------------------

    @staticmethod
    def parse_dockerfile(text):
        """[(INSTRUCTION, arguments)] with continuation lines joined and comments dropped."""
        out = []
        pending = ""
        for raw in text.splitlines():
            stripped = raw.strip()
            if stripped.startswith("#") and not pending:
                continue
            if stripped.startswith("#"):
                continue  # a comment line inside a continued instruction
            line = pending + stripped
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            pending = ""
            if line:
                parts = line.split(None, 1)
                out.append((parts[0].upper(), parts[1] if len(parts) > 1 else ""))
        return out

    def dockerfile_entry(self, f):
        """(binary, CMD list) of a Dockerfile's final stage, checking it on the way; None when broken."""
        rel = self.rel(f)
        instructions = self.parse_dockerfile(open(f, encoding="utf-8").read())
        stages = [i for i, (ins, _) in enumerate(instructions) if ins == "FROM"]
        if not self.r.check(stages, rel, "has no FROM"):
            return None
        final = instructions[stages[-1]:]
        entry = [a for ins, a in final if ins == "ENTRYPOINT"]
        cmd = [a for ins, a in final if ins == "CMD"]
        try:
            entry = json.loads(entry[-1]) if entry else None
            cmd = json.loads(cmd[-1]) if cmd else []
        except ValueError as e:
            self.r.fail(rel, f"ENTRYPOINT/CMD is not a JSON array (exec form): {e}")
            return None
        if not self.r.check(isinstance(entry, list) and len(entry) == 1 and entry[0].startswith(INSTALL_DIR), rel,
                            f"ENTRYPOINT must be [\"{INSTALL_DIR}<binary>\"], got {entry}"):
            return None
        binary = entry[0][len(INSTALL_DIR):]
        if not self.r.check(os.access(os.path.join(self.bindir, binary), os.X_OK), rel,
                            f"ENTRYPOINT runs {binary}, which is not a binary of {self.bindir}"):
            return None
        builds = any(ins == "RUN" and (re.search(r"--target\s+(\S+\s+)*?" + re.escape(binary) + r"\b", a)
                                       or re.search(r"\bmake\b", a)) for ins, a in instructions[:stages[-1]])
        copies = any(ins == "COPY" and re.search(r"/bin/" + re.escape(binary) + r"\s+" + re.escape(INSTALL_DIR + binary)
                                                 + r"\s*$", a) for ins, a in final)
        self.r.check(builds, rel, f"no build stage builds {binary} (cmake --target {binary} or make)")
        self.r.check(copies, rel, f"the final stage does not COPY .../bin/{binary} to {INSTALL_DIR}{binary}")
        if builds and copies:
            self.r.ok(f"{rel}: builds {binary}, copies it to {INSTALL_DIR}{binary}, ENTRYPOINT {entry}")
        if cmd:
            self.check_invocation(f"{rel} CMD", binary, cmd)
        return binary, cmd

    def check_dockerfiles(self):
        self.images = {}
        files = [f for f in self.files_under(os.path.join("deploy", "docker"), ("Dockerfile",))]
        if not self.r.check(bool(files), "deploy/docker/", "no Dockerfiles"):
            return
        for f in files:
            result = self.dockerfile_entry(f)
            if result:
                self.images[self.rel(f)] = result

    # ---- compose -------------------------------------------------------------------------------------------------

    def check_compose(self):
        rel = os.path.join("deploy", "docker", "compose.yaml")
        docs = self.docs(rel)
        if not docs:
            return
        compose = docs[0]
        base = os.path.dirname(self.path(rel))
        services = compose.get("services") or {}
        if not self.r.check(services, rel, "no services"):
            return
        mark = self.r.mark()
        declared_volumes = set((compose.get("volumes") or {}).keys())
        declared_secrets = set((compose.get("secrets") or {}).keys())
        metrics_targets = set()
        for name, svc in services.items():
            where = f"{rel} service {name}"
            binary = None
            cmd_default = []
            build = svc.get("build")
            if isinstance(build, dict):
                dockerfile = os.path.normpath(os.path.join(base, build.get("context", "."),
                                                           build.get("dockerfile", "Dockerfile")))
                if self.r.check(os.path.exists(dockerfile), where, f"builds from {dockerfile}, which does not exist"):
                    binary, cmd_default = self.images.get(self.rel(dockerfile), (None, []))
            entrypoint = svc.get("entrypoint")
            if entrypoint:
                entrypoint = shlex.split(entrypoint) if isinstance(entrypoint, str) else list(entrypoint)
                binary = os.path.basename(entrypoint[0])
            command = svc.get("command", None)
            if isinstance(command, str):
                command = shlex.split(command)
            if binary:
                args = (entrypoint[1:] if entrypoint else []) + (command if command is not None else cmd_default)
                self.check_invocation(where, binary, [str(a) for a in args])
                listen = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--metrics-listen"]
                for address in listen:
                    metrics_targets.add(f"{name}:{address.rsplit(':', 1)[1]}")
            for s in svc.get("secrets") or []:
                s = s if isinstance(s, str) else s.get("source")
                self.r.check(s in declared_secrets, where, f"uses the secret '{s}', which is not declared")
            for v in svc.get("volumes") or []:
                source = v.split(":", 1)[0] if isinstance(v, str) else v.get("source", "")
                if not source or "$" in source:
                    continue
                if source.startswith((".", "/")):
                    self.r.check(os.path.exists(os.path.normpath(os.path.join(base, source))), where,
                                 f"bind-mounts {source}, which does not exist")
                else:
                    self.r.check(source in declared_volumes, where, f"uses the volume '{source}', not declared")
            for dep in svc.get("depends_on") or []:
                self.r.check(dep in services, where, f"depends on '{dep}', which is not a service")
        for s, spec in (compose.get("secrets") or {}).items():
            if "file" in spec:
                folder = os.path.dirname(os.path.normpath(os.path.join(base, spec["file"])))
                self.r.check(os.path.isdir(folder), rel, f"secret '{s}': the folder {folder} does not exist")
        if self.r.clean(mark):
            self.r.ok(f"{rel}: {len(services)} services; volumes, secrets and bind mounts resolve")
        # Prometheus's static targets should be exactly the metrics addresses of the compose services.
        for doc in self.docs(os.path.join("deploy", "prometheus", "prometheus.yml")):
            targets = {t for job in doc.get("scrape_configs", []) if job.get("job_name", "").startswith("namm-")
                       for sc in job.get("static_configs", []) for t in sc.get("targets", [])}
            if self.r.check(targets == metrics_targets, "deploy/prometheus/prometheus.yml",
                            f"namm targets {sorted(targets)} differ from the compose services' --metrics-listen "
                            f"addresses {sorted(metrics_targets)}"):
                self.r.ok(f"deploy/prometheus/prometheus.yml: targets match the compose services ({len(targets)})")

    def check_compose_keys(self):
        """The compose instructions give the TLS keys to the images' user: a bind mount keeps the host's owner and
        make-certs.sh's mode 0600, so the containers (USER namm) could not open them and restarted over and over.
        And make-certs.sh --key-owner does so (run when openssl is installed and we are root)."""
        uids = set()
        for f in self.files_under(os.path.join("deploy", "docker"), ("Dockerfile",)):
            uids |= set(re.findall(r"useradd\b[^\n]*--uid (\d+)", open(f).read()))
        if not self.r.check(len(uids) == 1, "deploy/docker/", f"the images' users have uids {sorted(uids)}, not one"):
            return
        uid = uids.pop()
        for rel in (os.path.join("deploy", "docker", "compose.yaml"), os.path.join("deploy", "README.md")):
            commands = [line for line in open(self.path(rel)) if "make-certs.sh" in line and "deploy/docker/tls" in line]
            if self.r.check(commands, rel, "does not say how to make deploy/docker/tls (make-certs.sh)") and \
                    self.r.check(all(f"--key-owner {uid} " in c for c in commands), rel,
                                 f"make-certs.sh without --key-owner {uid} (the images' uid): {commands}"):
                self.r.ok(f"{rel}: make-certs.sh gives the keys to uid {uid}")
        script = self.path(os.path.join("deploy", "tls", "make-certs.sh"))
        if os.geteuid() != 0 or not shutil.which("openssl"):
            self.r.skip("make-certs.sh --key-owner: needs root and openssl")
            return
        with tempfile.TemporaryDirectory() as out:
            made = subprocess.run([script, "--key-owner", uid, out, "coordinator"], capture_output=True, text=True)
            if not self.r.check(made.returncode == 0, script, f"failed: {made.stderr}"):
                return
            modes = {name: (os.stat(os.path.join(out, name)).st_uid, oct(os.stat(os.path.join(out, name)).st_mode & 0o777))
                     for name in ("server.key", "worker.key", "ca.pem", "server.pem", "worker.pem")}
            wanted = {"server.key": (int(uid), "0o600"), "worker.key": (int(uid), "0o600")}
            if self.r.check(all(modes[k] == v for k, v in wanted.items()) and
                            all(modes[k][1] == "0o644" for k in ("ca.pem", "server.pem", "worker.pem")),
                            script, f"--key-owner {uid}: owners and modes {modes}"):
                self.r.ok(f"deploy/tls/make-certs.sh --key-owner {uid}: the keys are uid {uid}'s, mode 0600")

    # ---- run specs -----------------------------------------------------------------------------------------------

    def check_run_specs(self):
        """Run specs in deploy/ use the keys of the repository's own specs (coordinator/runs/*.yaml)."""
        known = {}
        for f in self.files_under(os.path.join("coordinator", "runs"), (".yaml",)):
            self.merge_keys(known, yaml.safe_load(open(f, encoding="utf-8")))
        if not known:
            self.r.skip("coordinator/runs/ not found: run specs in deploy/ not compared")
            return
        specs = [(os.path.join("deploy", "docker", "stories-cpu.yaml"), self.docs(os.path.join("deploy", "docker",
                                                                                                 "stories-cpu.yaml")))]
        for doc in self.docs(os.path.join("deploy", "k8s", "configmap-run.yaml")):
            for key, value in (doc.get("data") or {}).items():
                specs.append((f"deploy/k8s/configmap-run.yaml data.{key}", [yaml.safe_load(value)]))
        for where, docs in specs:
            for spec in docs:
                unknown = self.unknown_keys(known, spec)
                ok = self.r.check(not unknown, where, f"run spec keys unknown to coordinator/runs/*.yaml: {unknown}")
                for key in ("name", "model", "stages"):
                    ok &= self.r.check(key in spec, where, f"run spec without '{key}'")
                if ok:
                    self.r.ok(f"{where}: run spec with known keys, stages {[s['tasks'] for s in spec['stages']]}")

    def merge_keys(self, into, value):
        if isinstance(value, dict):
            for k, v in value.items():
                self.merge_keys(into.setdefault(k, {}), v)
        elif isinstance(value, list):
            for v in value:
                self.merge_keys(into, v)

    def unknown_keys(self, known, value, prefix=""):
        out = []
        if isinstance(value, dict):
            for k, v in value.items():
                if k not in known:
                    out.append(prefix + k)
                else:
                    out += self.unknown_keys(known[k], v, prefix + k + ".")
        elif isinstance(value, list):
            for v in value:
                out += self.unknown_keys(known, v, prefix)
        return out

    # ---- Kubernetes ----------------------------------------------------------------------------------------------

    def check_k8s(self):
        k8s_dir = os.path.join("deploy", "k8s")
        objects = []  # (file, doc)
        kustomizations = []
        for rel, docs in sorted(self.yaml_docs.items()):
            if not rel.startswith(k8s_dir + os.sep):
                continue
            for doc in docs:
                if doc.get("kind") == "Kustomization":
                    kustomizations.append((rel, doc))
                else:
                    objects.append((rel, doc))
        if not self.r.check(objects, k8s_dir, "no Kubernetes objects"):
            return
        by_kind = {}
        namespaces = {(d.get("metadata") or {}).get("name") for _, d in objects if d.get("kind") == "Namespace"}
        namespaces.discard(None)
        for rel, d in objects:
            meta = d.get("metadata") or {}
            ok = True
            for field, value in (("apiVersion", d.get("apiVersion")), ("kind", d.get("kind")),
                                 ("metadata.name", meta.get("name"))):
                ok &= self.r.check(isinstance(value, str) and value, rel, f"an object without {field}")
            if not ok:
                continue
            if d["kind"] != "Namespace":
                ok &= self.r.check(meta.get("namespace") in namespaces, rel,
                                   f"{d['kind']}/{meta['name']}: namespace {meta.get('namespace')!r} is not one of "
                                   f"the Namespaces defined here {sorted(namespaces)}")
            by_kind.setdefault(d["kind"], {})[meta["name"]] = (rel, d)
        workloads = {k: by_kind.get(k, {}) for k in ("Deployment", "StatefulSet", "Job", "DaemonSet")}
        pod_templates = []  # (where, labels, pod spec)
        for kind, items in workloads.items():
            for name, (rel, d) in items.items():
                mark = self.r.mark()
                where = f"{rel} {kind}/{name}"
                spec = d.get("spec") or {}
                template = spec.get("template") or {}
                labels = (template.get("metadata") or {}).get("labels") or {}
                pod = template.get("spec") or {}
                if kind != "Job":
                    selector = (spec.get("selector") or {}).get("matchLabels") or {}
                    if self.r.check(selector, where, "no spec.selector.matchLabels"):
                        self.r.check(all(labels.get(k) == v for k, v in selector.items()), where,
                                     f"selector {selector} does not match the pod template's labels {labels}")
                if kind == "StatefulSet":
                    service = spec.get("serviceName")
                    self.r.check(service in by_kind.get("Service", {}), where,
                                 f"serviceName {service!r} is not a Service defined here")
                    # The coordinator owns a SQLite database: exactly one writer.
                    self.r.check(spec.get("replicas", 1) == 1, where, "a coordinator StatefulSet must have 1 replica "
                                                                      "(one writer of the SQLite database)")
                pod_templates.append((where, labels, pod, template.get("metadata") or {}, spec, d))
                if self.r.clean(mark):
                    self.r.ok(f"{where}: apiVersion, kind, name, namespace" + ("" if kind == "Job" else ", selector")
                              + (", serviceName, 1 replica" if kind == "StatefulSet" else ""))
        for where, labels, pod, meta, spec, d in pod_templates:
            self.check_pod(where, pod, meta, spec, by_kind)
        for name, (rel, svc) in by_kind.get("Service", {}).items():
            mark = self.r.mark()
            where = f"{rel} Service/{name}"
            selector = (svc.get("spec") or {}).get("selector") or {}
            pods = [p for p in pod_templates if selector and all(p[1].get(k) == v for k, v in selector.items())]
            if not self.r.check(pods, where, f"selector {selector} matches no pod template defined here"):
                continue
            port_names = {p.get("name") for c in pods[0][2].get("containers", []) for p in c.get("ports", [])}
            port_numbers = {p.get("containerPort") for c in pods[0][2].get("containers", []) for p in c.get("ports", [])}
            for port in (svc.get("spec") or {}).get("ports") or []:
                target = port.get("targetPort", port.get("port"))
                self.r.check(target in port_names or target in port_numbers, where,
                             f"targetPort {target!r} is not a port of the pods it selects")
            if self.r.clean(mark):
                self.r.ok(f"{where}: selects {pods[0][0].split(' ', 1)[1]}, ports resolve")
        for rel, k in kustomizations:
            resources = k.get("resources") or []
            if all([self.r.check(os.path.exists(os.path.join(self.path(os.path.dirname(rel)), resource)), rel,
                                 f"resource {resource} does not exist") for resource in resources]):
                self.r.ok(f"{rel}: its {len(resources)} resources exist")
        kubectl = shutil.which("kubectl")
        for rel, _ in kustomizations:
            if kubectl is None:
                self.r.skip(f"kubectl is not installed: `kubectl kustomize {os.path.dirname(rel)}` not run")
                continue
            proc = subprocess.run([kubectl, "kustomize", self.path(os.path.dirname(rel))], capture_output=True,
                                  text=True, timeout=120)
            if proc.returncode == 0:
                self.r.ok(f"kubectl kustomize {os.path.dirname(rel)}")
            else:
                self.r.fail(rel, f"kubectl kustomize failed: {proc.stderr.strip()}")

    def check_pod(self, where, pod, meta, workload_spec, by_kind):
        containers = pod.get("containers") or []
        if not self.r.check(containers, where, "no containers"):
            return
        volumes = {v.get("name"): v for v in pod.get("volumes") or []}
        claim_templates = {(t.get("metadata") or {}).get("name") for t in workload_spec.get("volumeClaimTemplates") or []}
        for name, v in volumes.items():
            if "configMap" in v:
                self.r.check(v["configMap"].get("name") in by_kind.get("ConfigMap", {}), where,
                             f"volume {name}: ConfigMap {v['configMap'].get('name')!r} is not defined here")
            if "secret" in v:
                self.r.check(v["secret"].get("secretName") in by_kind.get("Secret", {}), where,
                             f"volume {name}: Secret {v['secret'].get('secretName')!r} is not defined here")
            if "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"].get("claimName")
                # A claim of its own, or one a StatefulSet here creates: <template>-<statefulset>-<ordinal>.
                stateful = {f"{(t.get('metadata') or {}).get('name')}-{sts}-{i}"
                            for sts, (_, d) in by_kind.get("StatefulSet", {}).items()
                            for t in (d.get("spec") or {}).get("volumeClaimTemplates") or []
                            for i in range((d.get("spec") or {}).get("replicas", 1))}
                self.r.check(claim in by_kind.get("PersistentVolumeClaim", {}) or claim in stateful, where,
                             f"volume {name}: PersistentVolumeClaim {claim!r} is not defined here")
        annotations = meta.get("annotations") or {}
        for c in containers:
            mark = self.r.mark()
            cwhere = f"{where} container {c.get('name')}"
            if not self.r.check(c.get("name") and c.get("image"), cwhere, "a container needs a name and an image"):
                continue
            ports = {p.get("name"): p.get("containerPort") for p in c.get("ports") or []}
            for p in c.get("ports") or []:
                self.r.check(isinstance(p.get("containerPort"), int), cwhere, f"containerPort {p} is not an integer")
            for mount in c.get("volumeMounts") or []:
                self.r.check(mount.get("name") in volumes or mount.get("name") in claim_templates, cwhere,
                             f"mounts {mount.get('name')!r}, which is not a volume of the pod")
            for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
                probe = c.get(probe_name)
                if probe is None:
                    continue
                handlers = [h for h in ("httpGet", "tcpSocket", "exec", "grpc") if h in probe]
                if not self.r.check(len(handlers) == 1, cwhere, f"{probe_name} needs exactly one handler"):
                    continue
                port = (probe[handlers[0]] or {}).get("port")
                if handlers[0] in ("httpGet", "tcpSocket"):
                    self.r.check(port in ports or port in ports.values(), cwhere,
                                 f"{probe_name} probes port {port!r}, which the container does not declare")
            command = [str(a) for a in (c.get("command") or [])]
            args = [str(a) for a in (c.get("args") or [])]
            if not self.r.check(command and command[0].startswith(INSTALL_DIR), cwhere,
                                f"command must start with {INSTALL_DIR}<binary>, got {command}"):
                continue
            binary = command[0][len(INSTALL_DIR):]
            if not self.r.check(os.access(os.path.join(self.bindir, binary), os.X_OK), cwhere,
                                f"runs {binary}, which is not a binary of {self.bindir}"):
                continue
            argv = command[1:] + args
            self.check_invocation(cwhere, binary, argv)
            if not argv or argv[0] != "serve":
                continue
            # Daemons: scraped on their --metrics-listen port, drained on SIGTERM.
            listen = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--metrics-listen"]
            if self.r.check(listen, cwhere, "a serve daemon without --metrics-listen cannot be scraped"):
                port = int(listen[0].rsplit(":", 1)[1])
                self.r.check(annotations.get("prometheus.io/scrape") == "true", where,
                             "pod template lacks the annotation prometheus.io/scrape: \"true\"")
                self.r.check(str(annotations.get("prometheus.io/port")) == str(port), where,
                             f"annotation prometheus.io/port {annotations.get('prometheus.io/port')!r} is not the "
                             f"--metrics-listen port {port}")
                self.r.check(ports.get("metrics") == port, cwhere,
                             f"no container port named 'metrics' on {port} (Prometheus discovery keeps that one)")
            grace = pod.get("terminationGracePeriodSeconds", 30)
            self.r.check(grace >= 60, where, f"terminationGracePeriodSeconds {grace} is too short for a drain")
            if binary == "namm-worker":
                limits = (c.get("resources") or {}).get("limits") or {}
                self.r.check(str(limits.get("nvidia.com/gpu")) == "1", cwhere, "a worker pod should limit "
                                                                               "nvidia.com/gpu to 1 (one worker per GPU)")
                self.r.check(c.get("livenessProbe", {}).get("httpGet", {}).get("path") == "/metrics", cwhere,
                             "worker liveness should be an httpGet of /metrics")
            if binary == "namm-coordinator":
                grpc = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--listen"]
                self.r.check("tcpSocket" in (c.get("livenessProbe") or {}), cwhere,
                             "coordinator liveness should be a tcpSocket probe of the gRPC port")
                self.r.check(grpc and int(grpc[0].rsplit(":", 1)[1]) in ports.values(), cwhere,
                             f"--listen {grpc} is not a declared container port")
            if self.r.clean(mark):
                self.r.ok(f"{cwhere}: image {c['image']}, probes, ports, mounts and annotations consistent")

    # ---- all -----------------------------------------------------------------------------------------------------

    def run(self):
        for binary in BINARIES:
            exe = os.path.join(self.bindir, binary)
            if not os.access(exe, os.X_OK):
                self.r.fail(exe, "missing or not executable (give --bin the directory of the built binaries)")
        if self.r.problems:
            return self.finish()
        documented = self.documented_metrics()
        self.check_yaml_parses()
        self.check_dashboard(documented)
        self.check_provisioning()
        self.check_prometheus(documented)
        self.check_systemd()
        self.check_dockerfiles()
        self.check_compose()
        self.check_compose_keys()
        self.check_run_specs()
        self.check_k8s()
        return self.finish()

    def finish(self):
        if self.r.problems:
            print(f"\ncheck_deploy: {len(self.r.problems)} problem(s), {self.r.passed} checks passed:")
            for p in self.r.problems:
                print(f"  - {p}")
            return 1
        print(f"\ncheck_deploy: all {self.r.passed} checks passed")
        return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", required=True, help="repository root")
    parser.add_argument("--bin", required=True, help="directory holding namm-coordinator and namm-worker")
    args = parser.parse_args()
    if not os.path.isdir(os.path.join(args.repo, "deploy")):
        print(f"check_deploy: {args.repo} has no deploy/ directory", file=sys.stderr)
        return 2
    return Checker(args.repo, args.bin).run()


if __name__ == "__main__":
    sys.exit(main())
