# The training settings both launch paths share, examples_zero/common.sh and ALCF/args.sh (sourced by them, never
# run). The launch planner's settings (megatron/launch/settings.py, one Python process without torch) check every
# variable once (one line naming it, its value and what is expected), give each its one default, do the batch
# arithmetic, read a user's DeepSpeed JSON (DS_CONFIG), and hand back the pretrain_gpt.py flags both paths pass,
# TRAINING_DEFAULT_FLAGS, with TRAINING_DEFAULT_SOURCES naming the variable behind each flag. docs/environment.md
# lists them all.
# The caller sets first:
#   ZL_ACCELERATOR  cuda or cpu: the defaults follow it (a CPU run is a few minutes on CPU ranks)
#   ZL_WORLD        every rank of the job (all hosts)
#   MODEL_SIZE      the preset (megatron/model/presets.py), and ZL_MODEL_VARIABLE, the variable it came from
#   zl_alcf_names=1 and zl_sp_variable on the ALCF path (messages name MPSIZE, DTYPE, ...; SP_TYPE)
# and reads back, besides the flags: SEQ_LEN, MICRO_BATCH, GAS, GLOBAL_BATCH, DPSIZE, TP, PP, SP, PRECISION (and
# precision_set, 1 when it was given), USE_ACTIVATION_CHECKPOINTING, LOG_INTERVAL, EVAL_INTERVAL, EVAL_ITERS,
# SAVE_INTERVAL, DATA_DIR, DATA_PATH and the rest with their defaults.

# The script's upper-case variables, exported or not, are what the settings read.
zl_given_variables=()
for zl_var in $(compgen -v); do
    [[ "$zl_var" =~ ^[A-Z][A-Z0-9_]*$ && "$zl_var" != BASH* ]] && zl_given_variables+=("$zl_var=${!zl_var-}")
done
zl_settings=$("$PYTHON" -m megatron.launch.settings --accelerator "$ZL_ACCELERATOR" --world "$ZL_WORLD" \
    --model-size "$MODEL_SIZE" --model-variable "$ZL_MODEL_VARIABLE" --sp-variable "${zl_sp_variable:-SP}" \
    ${zl_alcf_names:+--alcf-names} -- "${zl_given_variables[@]}") || exit 1
eval "$zl_settings"
