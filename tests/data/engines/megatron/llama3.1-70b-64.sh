# llama3.1-70b-64: NVIDIA dgxc-benchmarking llama3.1 recipe (calibration/h100_public.yaml dgxc_llama31) as Megatron-LM flags
torchrun --nproc-per-node 8 --nnodes 8 pretrain_gpt.py \
    --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 \
    --group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm \
    --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear \
    --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 128 \
    --tensor-model-parallel-size 4 --sequence-parallel --tp-comm-overlap \
    --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 4 \
    --context-parallel-size 2 --cp-comm-type p2p \
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --grad-reduce-in-bf16 --bf16
