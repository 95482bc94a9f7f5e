import sys, torch, transformers as tf
from mamba_captum.evaluation import compare
from mamba_captum.evaluation.compare import Method, _ours, captum_methods
from mamba_captum import MambaAttribution, MambaRollout
torch.set_num_threads(1)
extra = {}
try:
    import sel_proto
    extra = sel_proto.METHODS
except ImportError:
    pass
for name in sys.argv[1:]:
    shipped = name.startswith("s:")
    family, task_name = name.removeprefix("s:").split("-")
    if shipped:
        from mamba_captum.evaluation.models import load_classifier
        model, _ = load_classifier(family, task_name)
    else:
        model = tf.AutoModelForCausalLM.from_pretrained(f"/tmp/selmodels/{name}").eval()
    task = compare.evaluation_task(task_name, 64)
    import os
    methods = [Method("Attribution (default)", "ours", _ours(MambaAttribution))]
    if not os.environ.get("QUICK"):
        methods += [Method("Rollout", "ours", _ours(MambaRollout))] + captum_methods()[:4]
    else:
        methods += [captum_methods()[3]]
    methods += [Method(k, "proto", v) for k, v in extra.items()]
    rows = compare.evaluate_model(model, task, methods, family, perturbation=False)
    for r in rows:
        print(f"{name:22s} {r['method']:40s} roc {r['roc_auc']:.3f} p@k {r['precision_at_k']:.3f} {r['seconds']:.2f}s", flush=True)
