"""Runner type kubernetes: a ConfigMap (+ Secret) + PyTorchJob (hfscale.launch.runners.kubernetes_manifest),
applied with ``kubectl apply -f -``.

The pods read the generated files from the ConfigMap at ``CONFIG_DIR``, so the run directory only
keeps a record: its copy of the manifests always has the secrets masked; the real ones reach
kubectl on stdin. Without a kubectl context the manifests are written and the apply command
printed. This module also knows what to ask kubectl first.
"""

from __future__ import annotations

import posixpath

from hfscale.core.shell import Command, Text, words
from hfscale.launch.context import Common, LaunchContext
from hfscale.launch.runners.kubernetes_manifest import API_VERSION, CONFIG_DIR, LABEL, kubernetes_manifests, launcher_command, render_manifests
from hfscale.launch.runners.shared import Submitted, Unavailable
from hfscale.launch.spec import LaunchPlan, NodeLaunch
from hfscale.rules.resolved import Job

RANK_DIR = CONFIG_DIR  # where the pods read the generated files
MANIFESTS = "pytorchjob.yaml"


def plan(job: Job, ctx: LaunchContext, c: Common) -> LaunchPlan:
    files = dict(c.files)

    def manifests(shown: bool) -> str:
        return render_manifests(kubernetes_manifests(job, ctx, files, c.env, shown=shown))

    record = manifests(True)
    main = Command(("kubectl", "apply", "-f", "-"), stdin=Text(real=manifests(False), shown=record))
    notes = (*c.notes, f"kubectl reads the manifests on stdin ({MANIFESTS} with the secrets' real values)")
    node = NodeLaunch(None, None, words(launcher_command(job, ctx)))
    return LaunchPlan(ctx.job_id, "kubernetes", c.run_dir, (*c.files, (MANIFESTS, record)), (node,) * job.num_nodes,
                      ("kubernetes",), main, None, "done" if c.done else "submit", notes, show=(MANIFESTS,),
                      moves=c.moves)


def probe(plan: LaunchPlan) -> Command:
    """Asked before applying: a current context means a configured kubectl."""
    return Command(("kubectl", "config", "current-context"), plan.main.env, plan.main.cwd)


def unavailable(plan: LaunchPlan) -> Unavailable:
    """Without a configured kubectl the written manifests are the result: say how to apply them."""
    path = posixpath.join(plan.run_dir, MANIFESTS)
    return Unavailable(f"hfscale: no configured kubectl (no current context); the manifests are in {path} (secrets as ***: "
            f"fill them in first). Apply them with:\n  kubectl apply -f {path}", 0)


def submitted(plan: LaunchPlan, stdout: str) -> Submitted:
    """(files to record, what to say) after kubectl applied the manifests."""
    return Submitted({}, f"hfscale: applied; follow it with: kubectl get pytorchjob -l hfscale.job={plan.job_id}")


# what an hfscale launch creates: a stop deletes only these kinds
DELETABLE = {("v1", "ConfigMap"), ("v1", "Secret"), (API_VERSION, "PyTorchJob")}


def deletion(text: str, job_id: str) -> str:
    """From a run's recorded ``pytorchjob.yaml``: a manifest for ``kubectl delete -f -`` holding only
    each object's kind, name and namespace, each checked (a kind hfscale creates, RFC 1123 names,
    the job's label), so nothing else in the file reaches kubectl. Raises ValueError naming what is
    wrong."""
    from hfscale.core.records import RFC1123_LABEL, RFC1123_NAME
    from hfscale.config.yaml_source import dump_all, parse_all

    out = []
    for n, doc in enumerate(parse_all(text), 1):
        meta = doc.get("metadata") if isinstance(doc, dict) else None
        if not isinstance(meta, dict):
            raise ValueError(f"document {n} is not a Kubernetes object")
        kind, api, name, ns = doc.get("kind"), doc.get("apiVersion"), meta.get("name"), meta.get("namespace")
        labels = meta.get("labels") if isinstance(meta.get("labels"), dict) else {}
        if not (isinstance(api, str) and isinstance(kind, str)) or (api, kind) not in DELETABLE:
            raise ValueError(f"document {n}: {api!s:.60}/{kind!s:.60} is not a kind hfscale creates")
        if not isinstance(name, str) or not RFC1123_NAME.fullmatch(name):
            raise ValueError(f"document {n}: the name {name!r:.80} is not an RFC 1123 name")
        if not isinstance(ns, str) or not RFC1123_LABEL.fullmatch(ns):
            raise ValueError(f"document {n}: the namespace {ns!r:.80} is not an RFC 1123 label")
        if labels.get(LABEL) != job_id:
            raise ValueError(f"document {n}: {kind} {name} is not labelled {LABEL}={job_id}")
        out.append({"apiVersion": api, "kind": kind, "metadata": {"name": name, "namespace": ns}})
    if not out:
        raise ValueError("no Kubernetes objects in it")
    return dump_all(out)
