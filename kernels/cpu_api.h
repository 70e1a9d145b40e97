/* Every entry point of the CPU kernels' library, declared once. Each C source includes this
 * header, so the compiler checks each definition against its declaration here, and kernels/cpu/
 * derives its ctypes bindings (argument and result types, and the lmi_lin / lmi_layer structures)
 * from this text: the Python side cannot drift from the C prototypes. Keep one declaration per
 * entry point, parameters as `type name`, pointers as `type *name`. */
#ifndef LMI_CPU_API_H
#define LMI_CPU_API_H
#include <stdint.h>

/* Before a loop over a register block's rows: unrolled, the block's accumulator arrays stay in
 * registers (rolled, gcc kept them on the stack: a memset and stalled reloads per block). */
#define UNROLL_MR _Pragma("GCC unroll 16")

/* lmi_lin.kind */
enum { LIN_F32 = 0, LIN_BF16 = 1, LIN_BF16W = 2, LIN_I8 = 3, LIN_Q = 4 };

/* One packed linear layer (handler/model/cpu_stack.py fills these from the model's modules). */
typedef struct {
    int64_t kind, n, k;
    const void *panels;
    const int32_t *wsum;        /* int8: per-column sums of the weight */
    const float *wscale;        /* int8: per-column scales */
    const float *bias;          /* fp32 [n] or NULL */
    const void *qscale, *qmin;  /* LIN_Q (grouped 4/5/6/8-bit codes in panels): lmi_gemm_q's S and Mn */
    const float *qd, *qe;       /* LIN_Q, QS_I8: the superblock scales D and E */
    int64_t bits, group;        /* LIN_Q: 4, 5, 6 or 8-bit codes, `group` inputs per scale */
    int64_t qsmode, qsg;        /* LIN_Q: lmi_gemm_q's smode and sg */
    int64_t act8;               /* LIN_Q: lmi_gemm_q's act8 (option.cpu_grouped_activations=int8) */
} lmi_lin;

/* lmi_layer.qk_norm: RMSNorms of q and k before rotary (Llama's rounding): none, per head (Qwen3: over each
 * head's D) or over the whole projection (OLMoE: q's H * D, k's Hkv * D) */
enum { QK_NONE = 0, QK_HEAD = 1, QK_FULL = 2 };

/* A decoder layer: q/k/v and gate/up either fused (q holds q|k|v, gate holds gate|up; k, v, up
 * have n = 0) or apart. */
typedef struct {
    lmi_lin q, k, v, o, gate, up, down;
    const void *norm1, *norm2;  /* RMSNorm weights in the activations' dtype */
    void *kc, *vc;              /* this layer's KV pools */
    int64_t window;             /* sliding window, 0: none */
    float *ksc, *vsc;           /* int8 KV pools: their per-(token, head) row scales; NULL otherwise */
    const void *qn, *kn;        /* qk_norm's weights (activations' dtype), NULL with QK_NONE */
    int64_t qk_norm;            /* QK_NONE, QK_HEAD or QK_FULL */
    int64_t q_lanes, k_lanes;   /* fp32: lmi_rms_norm_f32's summing width for q's and k's normed rows */
    /* a mixture-of-experts MLP instead of gate/up/down (experts > 0): the router's fp32 panels
     * (lmi_gemm's, [experts] outputs), the experts' packed gate/up/down (lmi_lin [experts] each, as
     * lmi_moe_experts takes them), the top-k and lmi_moe_route's flags */
    const float *router;
    const lmi_lin *xgate, *xup, *xdown;
    int64_t experts, topk, route_norm, route_bf16;
    /* Qwen2-MoE's shared expert beside them (sdown.n > 0): its gate/up/down and its gate's fp32 panels
     * (one output), added as lmi_moe_shared adds it */
    lmi_lin sgate, sup, sdown;
    const float *shared_gate;
} lmi_layer;

/* decode attention's pool kind beside 0 (fp32) and 1 (bf16): int8 rows with fp32 scales */
enum { KV_I8 = 2 };

/* The keys a prompt chunk sees before its own rows (lmi_prefill_attention, lmi_step_layers): prompt p's
 * first ctx[p] positions, read from the paged pools through its block table (tables [P, tw]), the pools'
 * element strides and block size as lmi_decode_attention takes them; elements in the activations' dtype
 * (kv = 0 fp32, 1 bf16) or int8 with row scales ksc / vsc (kv = KV_I8, read back as q * scale, rounded to
 * bf16 for bf16 activations: what the prompt's own rows hold after lmi_kv_i8_roundtrip). */
typedef struct {
    const void *kc, *vc;
    const float *ksc, *vsc;
    int64_t kv, s_blk, s_tok, s_head, bs, tw;
    const int32_t *tables;
    const int64_t *ctx;
} lmi_kv_ctx;

/* cpu_gemm.c */
void lmi_pack_b(const float *W, int64_t N, int64_t K, float *out);
int lmi_gemm_available(void);
void lmi_gemm(const float *A, int64_t M, int64_t K, int64_t lda, const float *Bp, int64_t N, const float *bias,
    float *C, int64_t ldc, int nthreads);

float lmi_stream_read(const float *x, int64_t n, int64_t ahead, int nthreads);

/* cpu_gemm_bf16.c */
void lmi_pack_bf16(const uint16_t *W, int64_t N, int64_t K, uint16_t *out);
int lmi_gemm_bf16w_available(void);
void lmi_gemm_bf16w(const float *A, int64_t M, int64_t K, int64_t lda, const uint16_t *Bp, int64_t N,
    const float *bias, void *C, int64_t ldc, int out_bf16, int nthreads);
int lmi_gemm_bf16_available(void);
void lmi_bf16_rows(const float *A, int64_t M, int64_t K, int64_t lda, uint16_t *out, int64_t ldo, int nthreads);
void lmi_gemm_bf16(const uint16_t *A, int64_t M, int64_t K, int64_t lda, const uint16_t *Bp, int64_t N,
    const float *bias, void *C, int64_t ldc, int out_bf16, int nthreads);

/* cpu_gemm_i8.c */
void lmi_pack_i8(const int8_t *W, int64_t N, int64_t K, int8_t *out, int32_t *wsum);
void lmi_quant_rows(const float *A, int64_t M, int64_t K, int64_t lda, uint8_t *out, int64_t Kp, float *scales,
    int nthreads);
int lmi_gemm_i8_available(void);
void lmi_gemm_i8(const uint8_t *Aq, int64_t M, int64_t Kp, const float *sa, const int8_t *Bp, const int32_t *wsum,
    const float *sw, int64_t N, const float *bias, float *C, int64_t ldc, int nthreads);

/* cpu_gemm_q4.c; lmi_gemm_q's smode: how S and Mn hold the scales and mins (see the file's top) */
enum { QS_F32 = 0, QS_F16 = 1, QS_I8 = 2 };
int lmi_gemm_q_available(void);
int lmi_gemm_q_act8_available(void);
/* act8: int8 activations where the build has them (lmi_gemm_q_act8_available) and the weight qualifies */
void lmi_gemm_q(const float *A, int64_t M, int64_t K, int64_t lda, const uint8_t *Bp, const void *S,
    const void *Mn, const float *D, const float *E, int smode, int64_t sg, int bits, int64_t g, int64_t N,
    const float *bias, float *C, int64_t ldc, int act8, int nthreads);

/* cpu_exact.c */
void lmi_rotary(void *q, void *k, const void *cos, const void *sin, int64_t T, int64_t H, int64_t Hkv, int64_t D,
    int64_t qs, int64_t ks, int64_t cs, int bf16, int nthreads);
void lmi_rms_norm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t H, float eps, int W,
    float *sq);

/* cpu_decode.c */
int lmi_decode_attention(const float *q, const void *kc, const void *vc, int kv_bf16, int64_t s_blk, int64_t s_tok,
    int64_t s_head, const int32_t *tables, int64_t tw, const int32_t *lens, int64_t B, int64_t H, int64_t Hkv,
    int64_t D, int64_t bs, float scale, int64_t window, float softcap, float *out, int nthreads);
int lmi_decode_attention_i8(const float *q, const int8_t *kc, const int8_t *vc, const float *ksc, const float *vsc,
    int64_t s_blk, int64_t s_tok, int64_t s_head, const int32_t *tables, int64_t tw, const int32_t *lens, int64_t B,
    int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale, int64_t window, float softcap, float *out,
    int nthreads);
int lmi_decode_fused_i8(void *q, void *k, void *v, int64_t qs, int64_t ks, int64_t vs, const void *cos,
    const void *sin, int64_t cs, int bf16, int8_t *kc, int8_t *vc, float *ksc, float *vsc, int64_t s_blk,
    int64_t s_tok, int64_t s_head, const int64_t *slots, int64_t nslots, const int32_t *tables, int64_t tw,
    const int32_t *lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale, int64_t window,
    float softcap, void *out, int nthreads);
int lmi_write_kv(void *kc, void *vc, const void *key, const void *value, int64_t elem, int64_t s_blk, int64_t s_tok,
    int64_t s_head, int64_t k_tok, int64_t k_head, int64_t v_tok, int64_t v_head, const int64_t *slots, int64_t T,
    int64_t Hkv, int64_t D, int64_t bs, int64_t nslots);
int lmi_decode_fused(void *q, void *k, void *v, int64_t qs, int64_t ks, int64_t vs, const void *cos,
    const void *sin, int64_t cs, int bf16, void *kc, void *vc, int64_t s_blk, int64_t s_tok, int64_t s_head,
    const int64_t *slots, int64_t nslots, const int32_t *tables, int64_t tw, const int32_t *lens, int64_t B,
    int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale, int64_t window, float softcap, void *out,
    int nthreads);
void lmi_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t rows, int64_t H, float eps,
    int nthreads);
void lmi_row_stats(const float *x, int64_t rows, int64_t V, int64_t ld, int64_t *argmax, float *maxv, float *logsum,
    int nthreads);
/* (pc: the keys before each prompt's rows in the pools, NULL for whole prompts: see lmi_kv_ctx) */
int lmi_prefill_attention(const void *q, const void *k, const void *v, int64_t qs, int64_t ks, int64_t vs,
    int64_t qh, int64_t khs, int64_t vhs, void *out, int64_t os, int64_t oh, int bf16, const int64_t *starts,
    const int64_t *lens, const int64_t *order, int64_t P, int64_t H, int64_t Hkv, int64_t D, float scale,
    const lmi_kv_ctx *pc, int nthreads);
/* the same over an encoder's packed sequences, bidirectional (each row sees all its sequence's rows) */
int lmi_encoder_attention(const void *q, const void *k, const void *v, int64_t qs, int64_t ks, int64_t vs,
    int64_t qh, int64_t khs, int64_t vhs, void *out, int64_t os, int64_t oh, int bf16, const int64_t *starts,
    const int64_t *lens, const int64_t *order, int64_t P, int64_t H, int64_t Hkv, int64_t D, float scale,
    int nthreads);

/* cpu_kv.c: the int8 KV pool (kernels/cpu_kv.h) */
int lmi_write_kv_i8(int8_t *kc, int8_t *vc, float *ksc, float *vsc, const void *key, const void *value, int bf16,
    int64_t s_blk, int64_t s_tok, int64_t s_head, int64_t k_tok, int64_t k_head, int64_t v_tok, int64_t v_head,
    const int64_t *slots, int64_t T, int64_t Hkv, int64_t D, int64_t bs, int64_t nslots);

/* cpu_layer.c */
void lmi_set_sleef_expf(void *fn, int lanes);
void lmi_set_sleef_expf16(void *fn);
int lmi_silu_available(void);
int lmi_silu_lanes(void);
void lmi_silu_mul(void *g, const void *u, int64_t n, int bf16, int threads);
int lmi_step_layers(const lmi_layer *layers, int64_t L, void *h, int64_t T, int64_t B, int64_t E, int64_t H,
    int64_t Hkv, int64_t D, int64_t I, float eps, int lanes, int bf16, const void *cos, const void *sin, int64_t cs,
    const int64_t *slots, int64_t nslots, const int32_t *tables, int64_t tw, const int32_t *lens, int64_t P,
    const int64_t *pstarts, const int64_t *plens, const int64_t *porder, const int64_t *pctx,
    const int32_t *ptables, int64_t ptw, int64_t s_blk, int64_t s_tok, int64_t s_head, int64_t bs, float scale,
    int threads);
/* a step's rows through a mixture-of-experts MLP's experts, grouped by expert, the routing weights applied
 * as the down projection's rows come out (cpu_layer.c) */
int lmi_moe_experts(const lmi_lin *gate, const lmi_lin *up, const lmi_lin *down, int64_t X, const void *x,
    int64_t T, int64_t E, int64_t k, const int64_t *ids, const float *weights, void *out, int bf16, int threads);
/* out [T, E] += sigmoid(g[t]) * s[t] (a shared expert's output s, its gate's fp32 logit g) (cpu_layer.c) */
void lmi_moe_shared(void *out, const void *s, const float *g, int64_t T, int64_t E, int bf16);
/* each row's top-k experts and their weights from the router's fp32 logits, which it overwrites (cpu_layer.c) */
void lmi_moe_route(float *logits, int64_t T, int64_t X, int64_t k, int norm, int round_bf16, float *weights,
    int64_t *ids);
#endif
