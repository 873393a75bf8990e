// Block copies between tiers that are not runs of consecutive slots: one CTA row per block of
// one (stream, layer) plane, 16-byte words when every address and size allows it. Source and
// destination are device memory or page-locked host memory mapped into the device's address
// space, so one launch moves a scattered spill or warm that would otherwise be thousands of
// cuMemcpy calls.

struct Plane {
    unsigned long long src;         // address of the plane's layer slab in the source tier
    unsigned long long dst;         // same in the destination tier
    unsigned long long block_bytes; // bytes of one block in this plane
};

extern "C" __global__ void tier_copy(const Plane* planes, const unsigned int* pairs, int n_pairs) {
    const Plane p = planes[blockIdx.y];
    const unsigned long long bb = p.block_bytes;
    for (int i = blockIdx.x; i < n_pairs; i += gridDim.x) {
        const unsigned char* s = (const unsigned char*)(p.src + (unsigned long long)pairs[2 * i] * bb);
        unsigned char* d = (unsigned char*)(p.dst + (unsigned long long)pairs[2 * i + 1] * bb);
        if ((((unsigned long long)s | (unsigned long long)d | bb) & 15ull) == 0) {
            const uint4* s4 = (const uint4*)s;
            uint4* d4 = (uint4*)d;
            for (unsigned long long j = threadIdx.x; j < bb / 16; j += blockDim.x) d4[j] = s4[j];
        } else {
            for (unsigned long long j = threadIdx.x; j < bb; j += blockDim.x) d[j] = s[j];
        }
    }
}
