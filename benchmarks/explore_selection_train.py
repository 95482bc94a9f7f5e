import sys, json, torch
from mamba_captum.evaluation.models import train_classifier
fam_tasks = [a.split("/") for a in sys.argv[1:]]
for family, task in fam_tasks:
    model, record = train_classifier(family, task, log=lambda m: print(m, flush=True), max_steps=2000)
    model.save_pretrained(f"/tmp/selmodels/{family}-{task}")
    json.dump(record, open(f"/tmp/selmodels/{family}-{task}/training.json", "w"))
    print("DONE", record, flush=True)
