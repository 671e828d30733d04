// Read bandwidth of this machine with 1 and 2 threads: gcc -O3 -march=native -fopenmp read_bandwidth.c && ./a.out
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <omp.h>
#include <immintrin.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  size_t n = 427ull*1000*1000/4; float *a = aligned_alloc(64, n*4);
  for(size_t i=0;i<n;i++) a[i]=1.0f*(i&7);
  for(int th=1; th<=2; th++){
    omp_set_num_threads(th);
    double best=1e9; float sink=0;
    for(int r=0;r<10;r++){
      double t0=now(); float tot=0;
      #pragma omp parallel for reduction(+:tot)
      for(size_t blk=0; blk<n/16; blk+=64){
        __m512 acc0=_mm512_setzero_ps(),acc1=_mm512_setzero_ps(),acc2=_mm512_setzero_ps(),acc3=_mm512_setzero_ps();
        size_t end = blk+64 < n/16 ? blk+64 : n/16;
        for(size_t j=blk;j<end;j+=4){
          acc0=_mm512_add_ps(acc0,_mm512_load_ps(a+16*j));
          acc1=_mm512_add_ps(acc1,_mm512_load_ps(a+16*(j+1)));
          acc2=_mm512_add_ps(acc2,_mm512_load_ps(a+16*(j+2)));
          acc3=_mm512_add_ps(acc3,_mm512_load_ps(a+16*(j+3)));
        }
        tot += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0,acc1),_mm512_add_ps(acc2,acc3)));
      }
      double t=now()-t0; if(t<best)best=t; sink+=tot;
    }
    printf("threads %d: read %.1f GB/s (%.2f ms for 427MB) %f\n", th, n*4/best/1e9, best*1e3, sink);
  }
}
