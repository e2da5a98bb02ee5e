# llama3.1-8b-128: NVIDIA dgxc-benchmarking llama3.1 recipe (calibration/h100_public.yaml dgxc_llama31) as Megatron-LM flags
torchrun --nproc-per-node 8 --nnodes 16 pretrain_gpt.py \
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \
    --group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm \
    --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear \
    --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 2048 \
    --tensor-model-parallel-size 1 \
    --pipeline-model-parallel-size 1 \
    --context-parallel-size 2 --cp-comm-type p2p \
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --grad-reduce-in-bf16 --bf16
