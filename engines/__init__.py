"""engines: the built-in decoding engine (the lowest layer; imports nothing of specgate's).

    api.py                requests, results, stats, load; the Engine and GenerationHandle protocols
    errors.py             the errors an engine raises on purpose
    arms.py               what an arm is: Arm, its parser, ArmMenu (with each draft's kind), "is it served"
    config.py             EngineConfig (target, drafts, batching, budgets)
    loading.py            loading targets and drafts; GGUF conversion and cache
    llama.py              the lean Llama-family forward pass and its KV cache
    sampling.py           request sampling shape (temperature, top-k, top-p), its validation, and
                          its draws, fixed by seed and output position (and coupled picks)
    rejection_sampler.py  lossless speculative sampling, a pure function
    decode.py             the decode rules of one sequence (budget, verify, rollback, settle)
    scheduler.py          continuous batching: one target forward per step over every running row
    builtin.py            the engine: validation, queue, decode loop, handles
    drafts.py             proposer factories from config
    proposers/            draft proposers: prompt lookup, model drafts
    text.py               prompt encoding and incremental detokenization with stop strings
"""
