#!/usr/bin/env python3
"""Checks deploy/kubernetes/*.yaml: they parse; the training Job is an Indexed Job behind a headless
Service, with a preStop and a grace period above ddprun's --shutdown-timeout; its container's
command line and PET_* environment pass ddprun's own parser (pet_env_probe, which calls
launcher::parseCommandLine) with the values the manifest means; the rendezvous Deployment serves
the endpoint the Job names. A manifest ddprun would reject fails, and so does a broken copy (the
probe is shown to reject it).

    check_manifests.py SOURCE_DIR BUILD_DIR PET_ENV_PROBE
"""
import os
import subprocess
import sys
import tempfile

try:
    import yaml
except ImportError:
    print("SKIP: python3-yaml not installed (deploy/install-deps.sh installs it)")
    sys.exit(77)

src, build, probe = sys.argv[1:4]
kdir = os.path.join(src, "deploy", "kubernetes")


def fail(msg):
    print("FAIL: " + msg, file=sys.stderr)
    sys.exit(1)


def load(name):
    with open(os.path.join(kdir, name)) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    for d in docs:
        for key in ("apiVersion", "kind", "metadata"):
            if key not in d:
                fail(f"{name}: a document without {key}")
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def run_probe(args, pet_env):
    # PATH: the manifest names the program `train`, found on PATH in the image; here the build's.
    env = {"PATH": os.path.join(build, "examples") + ":/usr/bin:/bin"}
    env.update(pet_env)
    p = subprocess.run([probe] + args, env=env, capture_output=True, text=True, timeout=30)
    return p.returncode, p.stdout.strip() + p.stderr.strip()


rdzv = load("rendezvous.yaml")
job_docs = load("train-job.yaml")

# --- rendezvous: Deployment + Service; its command is the daemon's grammar ---
dep = rdzv.get(("Deployment", "ddprun-rendezvous")) or fail("no Deployment ddprun-rendezvous")
svc = rdzv.get(("Service", "ddprun-rendezvous")) or fail("no Service ddprun-rendezvous")
rc = dep["spec"]["template"]["spec"]["containers"][0]
cmd = rc["command"] + rc.get("args", [])
if cmd[0] != "ddprun-rendezvous" or "--listen" not in cmd:
    fail(f"rendezvous command {cmd}")
listen = cmd[cmd.index("--listen") + 1]
rdzv_port = int(listen.rsplit(":", 1)[1])
if svc["spec"]["selector"] != dep["spec"]["selector"]["matchLabels"]:
    fail("rendezvous Service does not select the Deployment's pods")
if rdzv_port not in [p["port"] for p in svc["spec"]["ports"]]:
    fail(f"rendezvous Service does not expose {rdzv_port}")
helptext = subprocess.run([os.path.join(build, "rendezvous", "ddprun-rendezvous"), "--help"],
                          capture_output=True, text=True).stdout
for a in cmd[1:]:
    if a.startswith("--") and a.split("=")[0] not in helptext:
        fail(f"ddprun-rendezvous has no flag {a}")

# --- training Job: Indexed, headless Service, graceful stop ---
job = job_docs.get(("Job", "ddprun-train")) or fail("no Job ddprun-train")
hsvc = job_docs.get(("Service", "ddprun-train")) or fail("no Service ddprun-train")
if hsvc["spec"].get("clusterIP") != "None":
    fail("the job's Service is not headless")
spec = job["spec"]
pod = spec["template"]["spec"]
if spec.get("completionMode") != "Indexed" or pod.get("subdomain") != "ddprun-train":
    fail("not an Indexed Job whose pods use the headless Service's subdomain")
if hsvc["spec"]["selector"] != {"job-name": "ddprun-train"}:
    fail("headless Service selector")
c = [c for c in pod["containers"] if c["name"] == "trainer"]
c = c[0] if c else fail("no container 'trainer'")
argv = c["command"] + c.get("args", [])
if argv[0] != "ddprun":
    fail(f"the trainer runs {argv[0]}, not ddprun")
if "preStop" not in c.get("lifecycle", {}):
    fail("no preStop hook")
shutdown = [a for a in argv if a.startswith("--shutdown-timeout=")]
if not shutdown or float(shutdown[0].split("=")[1]) >= pod["terminationGracePeriodSeconds"]:
    fail("terminationGracePeriodSeconds must exceed --shutdown-timeout")

pet = {}
for e in c["env"]:
    if "value" in e:
        pet[e["name"]] = e["value"]
    elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
        pet[e["name"]] = "10.0.0.7"  # what the kubelet would put there
    else:
        fail(f"env {e['name']}: unsupported valueFrom")
for name in ("PET_NNODES", "PET_RDZV_BACKEND", "PET_RDZV_ENDPOINT", "PET_MAX_RESTARTS",
             "PET_RDZV_CONF", "PET_NPROC_PER_NODE", "PET_N_PROC_PER_NODE"):
    if name not in pet:
        fail(f"the trainer's environment lacks {name}")
if pet["PET_NPROC_PER_NODE"] != pet["PET_N_PROC_PER_NODE"]:
    fail("PET_NPROC_PER_NODE and the operator's PET_N_PROC_PER_NODE differ")
if pet["PET_RDZV_ENDPOINT"] != f"ddprun-rendezvous:{rdzv_port}":
    fail(f"PET_RDZV_ENDPOINT {pet['PET_RDZV_ENDPOINT']} is not the rendezvous Service")
# Files from Secrets (the shared token): the probe reads them, so they are stood in for by files
# of a temporary directory, and the paths rewritten to it. Trainer and rendezvous must mount the
# same Secret, and the token must be in force on both sides.
def secret_mounts(pod_spec, container):
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod_spec.get("volumes", []) if "secret" in v}
    return {m["mountPath"]: secrets[m["name"]] for m in container.get("volumeMounts", [])
            if m["name"] in secrets}


stand_in = tempfile.mkdtemp(prefix="ddprun-manifest-")
trainer_secrets = secret_mounts(pod, c)
for mount in trainer_secrets:
    os.makedirs(stand_in + mount, exist_ok=True)
    with open(stand_in + mount + "/token", "w") as f:
        f.write("manifest-check-token\n")
    for k, v in list(pet.items()):
        pet[k] = v.replace(mount + "/", stand_in + mount + "/")
if "token_file=" in pet["PET_RDZV_CONF"]:
    rdzv_secrets = secret_mounts(dep["spec"]["template"]["spec"], rc)
    if "--token-file" not in cmd or not any(cmd[cmd.index("--token-file") + 1].startswith(m + "/")
                                            for m in rdzv_secrets):
        fail("the agents use a token but the rendezvous takes none from a Secret")
    if set(rdzv_secrets.values()) != set(trainer_secrets.values()):
        fail("trainer and rendezvous mount different Secrets for the token")
elif "--snapshot-dir" in " ".join(c.get("args", [])):
    fail("a multi-node --snapshot-dir without a token: ddprun refuses it (and anyone could plant a "
         "snapshot)")

lo, hi = (int(x) for x in pet["PET_NNODES"].split(":"))
if spec["parallelism"] != hi or spec["completions"] != hi:
    fail("parallelism/completions should be the job's maximum node count")

rc, out = run_probe(argv[1:], pet)
print("ddprun " + " ".join(argv[1:]) + "\n  -> " + out.replace("\n", "\n  -> "))
if rc != 0:
    fail("ddprun rejects the trainer's command line and environment: " + out)
for want in [f"nnodes={lo}:{hi}", f"nproc_per_node={pet['PET_NPROC_PER_NODE']}",
             "rdzv_backend=c10d", f"rdzv_endpoint={pet['PET_RDZV_ENDPOINT']}",
             f"max_restarts={pet['PET_MAX_RESTARTS']}", "local_addr=10.0.0.7",
             "snapshot_dir=/snapshots", f"rdzv_id={pet['PET_RDZV_ID']}"] + [
                 kv for kv in pet["PET_RDZV_CONF"].split(",") if not kv.startswith("token_file=")] + (
                     ["token=read"] if "token_file=" in pet["PET_RDZV_CONF"] else []):
    if want not in out.split():
        fail(f"ddprun did not take {want} from the manifest: {out}")

# The check has teeth: what the operator alone would write (PET_N_PROC_PER_NODE only) and a
# broken range.
only_operator = {k: v for k, v in pet.items() if k != "PET_NPROC_PER_NODE"}
rc, out = run_probe(argv[1:], only_operator)
if "nproc_per_node=" + pet["PET_N_PROC_PER_NODE"] not in out.split():
    print("note: ddprun does not read the operator's PET_N_PROC_PER_NODE yet (" + out.split()[2] +
          "); the manifest sets PET_NPROC_PER_NODE as well")
rc, out = run_probe(argv[1:], dict(pet, PET_NNODES=f"{hi}:{lo}" if hi != lo else "0:1"))
if rc == 0:
    fail("the probe accepted a broken PET_NNODES: " + out)
print("broken PET_NNODES rejected: " + out)
print("OK")
