# llama3.1-405b-32: NVIDIA dgxc-benchmarking llama3.1 recipe (calibration/h100_public.yaml dgxc_llama31) as Megatron-LM flags
torchrun --nproc-per-node 8 --nnodes 4 pretrain_gpt.py \
    --num-layers 7 --hidden-size 16384 --ffn-hidden-size 53248 --num-attention-heads 128 \
    --group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm \
    --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear \
    --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 126 \
    --tensor-model-parallel-size 8 --sequence-parallel --tp-comm-overlap \
    --pipeline-model-parallel-size 1 \
    --context-parallel-size 2 --cp-comm-type p2p \
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --grad-reduce-in-bf16 --bf16
