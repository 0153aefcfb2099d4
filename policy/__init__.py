"""policy: the per-request choice of arm (imports engines only).

    features.py      what the policy knows about a request when it decides
    classifier.py    the prompt category classifier (JSON in data/, no pickles)
    model.py         the speedup model: acceptance, round cost, tokens per round; its cold-start prior
    rules.py         operator rules in YAML (the shipped default_rules.yaml teaches them)
    decide.py        the pure decide(): rules, model, exploration, propensity
    train.py         fitting the model from TrainingRows and judging it offline
    cmd_rules.py     `specgate rules check|explain`; cmd_policy.py `specgate policy train-classifier`
"""
