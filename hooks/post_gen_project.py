"""Tidy the generated project: drop the files of the task(s) not chosen.  Never prompts: it must
run under ``--no-input`` with no terminal."""

import pathlib
import shutil

PROJECT = pathlib.Path.cwd()
PACKAGE = "{{ cookiecutter.package_name }}"
TASKS = "{{ cookiecutter.tasks }}"

SRC = f"src/{PACKAGE}"
CONFIGS = f"{SRC}/configs"
# The files only one task uses (paths relative to the project; a folder goes whole).  Everything
# else (entry points train/eval, builder, optimizer, LR schedule, loading, configs of the shared
# groups, LoRA adapters and the peft group) serves both tasks.
ONLY_FOR = {
    "classification": [
        f"{SRC}/tasks/classification",
        f"{SRC}/tasks/token_classification",  # (its module extends the sequence classifier's)
        f"{CONFIGS}/task/token_classification.yaml",
        f"{CONFIGS}/data/token_files.yaml",
        f"{CONFIGS}/experiment/ner_bert_base.yaml",
        f"{CONFIGS}/hparams_search/token_classification_optuna.yaml",
        "tests/test_token_classification.py",
        "tests/test_resume_identity.py",
        "tests/e2e/test_cli_token_classification.py",
        f"{CONFIGS}/task/classification.yaml",
        f"{CONFIGS}/data/local_files.yaml",
        f"{CONFIGS}/data/vader_movie_reviews.yaml",
        f"{CONFIGS}/data/glue_sst2.yaml",
        f"{CONFIGS}/model/minilm_l6.yaml",
        f"{CONFIGS}/model/bert_base_uncased.yaml",
        f"{CONFIGS}/model/tiny_bert.yaml",
        f"{CONFIGS}/experiment/demo_classification.yaml",
        f"{CONFIGS}/experiment/sst2_bert_base.yaml",
        f"{CONFIGS}/hparams_search/classification_optuna.yaml",
        "tests/test_data.py",
        "tests/test_train.py",
        "tests/test_metrics.py",
        "tests/real_data/test_demo_classification.py",
        "tests/e2e/test_cli_classification.py",
        "tests/test_assets.py",
        "tests/test_decoder_classifier.py",
        "tests/data/classifier_main_271a640.ckpt",  # a checkpoint of the previous format (test_safe_runs.py)
        "bench/throughput.py",
        "tests/slow/test_bench_scripts.py",
        "docs/tasks/classification.md",
    ],
    "causal_lm": [
        f"{SRC}/tasks/causal_lm",
        f"{SRC}/tasks/preference",  # (its module extends the causal LM's)
        f"{CONFIGS}/task/preference.yaml",
        f"{SRC}/tasks/reward",  # (its data module extends the preference pairs')
        f"{CONFIGS}/task/reward.yaml",
        f"{CONFIGS}/data/reward.yaml",
        f"{CONFIGS}/experiment/demo_reward_model.yaml",
        "tests/test_reward.py",
        "tests/real_data/test_demo_reward.py",
        f"{CONFIGS}/callbacks/benchmarks.yaml",  # lm-eval tasks (tasks/causal_lm/benchmarks.py)
        "tests/test_benchmarks.py",
        "tests/e2e/test_lm_eval_cli.py",
        f"{SRC}/tasks/grpo",  # (its data module extends the preference pairs', its module the causal LM's)
        f"{CONFIGS}/task/grpo.yaml",
        f"{CONFIGS}/grpo",
        f"{CONFIGS}/data/prompts.yaml",
        f"{CONFIGS}/data/vader_grpo.yaml",
        f"{CONFIGS}/experiment/demo_grpo_sentiment.yaml",
        f"{CONFIGS}/experiment/lm_llama31_8b_qlora_grpo.yaml",
        "tests/test_grpo.py",
        "tests/e2e/test_grpo_resume.py",
        f"{CONFIGS}/objective",
        f"{CONFIGS}/data/preference.yaml",
        f"{CONFIGS}/data/vader_dpo.yaml",
        f"{CONFIGS}/data/unpaired.yaml",
        f"{CONFIGS}/data/vader_kto.yaml",
        f"{CONFIGS}/experiment/demo_dpo_sentiment.yaml",
        f"{CONFIGS}/experiment/demo_kto_sentiment.yaml",
        f"{CONFIGS}/experiment/lm_llama31_8b_qlora_dpo.yaml",
        "tests/test_preference.py",
        "tests/test_peft_variants.py",
        "tests/test_training_callbacks.py",
        "tests/e2e/test_preference_resume.py",
        "tests/real_data/test_demo_dpo.py",
        "tests/real_data/test_demo_kto.py",
        f"{SRC}/core/assets/shakespeare.py",
        f"{SRC}/core/assets/gguf.py",
        f"{CONFIGS}/callbacks/neftune.yaml",  # (NEFTune: tasks/causal_lm/neftune.py)
        "tests/test_adapter_base.py",
        "tests/test_gguf_export.py",
        "tests/llama_cpp",  # (the llama_cpp tier: llama.cpp reads the GGUF exports)
        f"{SRC}/export.py",
        f"{SRC}/generate.py",
        f"{SRC}/chat.py",
        f"{SRC}/serve.py",
        f"{CONFIGS}/export.yaml",
        f"{CONFIGS}/generate.yaml",
        f"{CONFIGS}/chat.yaml",
        f"{CONFIGS}/serve.yaml",
        f"{CONFIGS}/task/causal_lm.yaml",
        f"{CONFIGS}/loss/chunked.yaml",
        f"{CONFIGS}/loss/liger.yaml",
        f"{CONFIGS}/experiment/lm_llama31_8b_lora.yaml",
        f"{CONFIGS}/experiment/lm_llama31_8b_full.yaml",
        f"{CONFIGS}/data/text_files.yaml",
        f"{CONFIGS}/data/shakespeare.yaml",
        f"{CONFIGS}/model/smollm2_135m.yaml",
        f"{CONFIGS}/model/smollm2_135m_hub.yaml",
        f"{CONFIGS}/model/tiny_llama.yaml",
        f"{CONFIGS}/model/tiny_gpt2.yaml",
        f"{CONFIGS}/model/llama32_1b.yaml",
        f"{CONFIGS}/model/llama31_8b.yaml",
        f"{CONFIGS}/experiment/demo_lm_lora.yaml",
        f"{CONFIGS}/experiment/demo_lm_scratch.yaml",
        f"{CONFIGS}/experiment/lm_smollm2_135m_full.yaml",
        f"{CONFIGS}/experiment/lm_llama32_1b_full.yaml",
        f"{CONFIGS}/experiment/lm_llama31_8b_qlora.yaml",
        f"{CONFIGS}/hparams_search/causal_lm_optuna.yaml",
        f"{CONFIGS}/hparams_search/lora_optuna.yaml",
        "tests/test_text_data.py",
        "tests/test_causal_lm.py",
        "tests/real_data/test_demo_causal_lm.py",
        "tests/test_lm_assets.py",
        "tests/test_levers.py",
        "tests/slow/test_compile.py",
        f"{SRC}/inspect_data.py",
        f"{CONFIGS}/inspect_data.yaml",
        f"{CONFIGS}/data/chat.yaml",
        f"{CONFIGS}/data/vader_sft.yaml",
        f"{CONFIGS}/experiment/demo_sft_sentiment.yaml",
        f"{CONFIGS}/experiment/lm_llama31_8b_qlora_chat.yaml",
        f"{CONFIGS}/experiment/lm_llama31_8b_qlora_chat_long.yaml",
        f"{CONFIGS}/experiment/lm_llama31_8b_qlora_chat_64k.yaml",
        f"{CONFIGS}/experiment/lm_llama31_8b_lora_24k.yaml",
        "tests/test_long_context.py",
        "tests/test_chat_data.py",
        "tests/test_chat.py",
        "tests/test_serve.py",
        "tests/real_data/test_demo_sft.py",
        "docs/tasks/causal_lm.md",
        "docs/tasks/preference.md",
    ],
}

for task, paths in ONLY_FOR.items():
    if TASKS in ("both", task):
        continue
    for relative in paths:
        path = PROJECT / relative
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:  # a stale list here would leave the other task's files behind: fail loudly
            raise SystemExit(f"post_gen_project: {relative} is listed for removal but was not generated")

# Empty folders that git would drop are kept with a .gitkeep.
for folder in ("data", "logs"):
    (PROJECT / folder).mkdir(exist_ok=True)
    (PROJECT / folder / ".gitkeep").touch()
