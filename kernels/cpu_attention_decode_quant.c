/* Decode rows over fp8 / int8 code pools (the kernel: cpu_attention_decode.h). */
#include "cpu_attention_decode.h"

void attend_token_codes(float *out, const float *q, const void *k_cache, const void *v_cache, const int32_t *table,
                        int64_t first_key, int64_t num_keys, int64_t heads, int64_t kv_heads, int64_t dim,
                        int64_t block_size, float scale, const KvScales *qs, int dtype, float *lse) {
    if (dtype == DT_FP8_E4M3) ATTEND_DIMS(DT_FP8_E4M3)
    else if (dtype == DT_FP8_E5M2) ATTEND_DIMS(DT_FP8_E5M2)
    else ATTEND_DIMS(DT_I8)
}
