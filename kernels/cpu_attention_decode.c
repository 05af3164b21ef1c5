/* Decode rows over fp32, bf16 and fp16 pools (the kernel: cpu_attention_decode.h). */
#include "cpu_attention_decode.h"

void attend_token_wide(float *out, const float *q, const void *k_cache, const void *v_cache, const int32_t *table,
                       int64_t first_key, int64_t num_keys, int64_t heads, int64_t kv_heads, int64_t dim,
                       int64_t block_size, float scale, const KvScales *qs, int dtype, float *lse) {
    if (dtype == DT_F32) ATTEND_DIMS(DT_F32)
    else if (dtype == DT_BF16) ATTEND_DIMS(DT_BF16)
    else ATTEND_DIMS(DT_F16)
}
