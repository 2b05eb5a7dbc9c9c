/* Scattered vs streaming reads of MLP weight rows, in plain C (no ONNX Runtime): the
 * hardware ceiling on what a row-gathering COUNTDOWN kernel could gain on this machine.
 * SmolLM2-135M shape: 30 layers of I=1536 rows x H=576 float32 (106 MB, beyond the caches);
 * a random sorted 30% of rows (D-COUNTDOWN at 70% act-sparsity).
 *   mode 0: memcpy the kept rows (what Gather does)
 *   mode 1: dot product with each kept row in place (a fused gather-GEMV)
 *   mode 2: the same with a software prefetch two rows ahead
 *   mode 3: dot product with every row (the dense GEMV, streaming)
 *   mode 4: prefetch four rows ahead
 * Usage: gcc -O3 -march=native -ffast-math bench/scattered_rows.c -o /tmp/sr && /tmp/sr
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define L 30
#define I 1536
#define H 576
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  float *W[L]; for(int l=0;l<L;l++){W[l]=aligned_alloc(64,sizeof(float)*I*H); for(long i=0;i<(long)I*H;i++)W[l][i]=(float)rand()/RAND_MAX;}
  int idx[I],k=0; srand(1); for(int i=0;i<I;i++) if(rand()%10<3) idx[k++]=i;
  float *out=aligned_alloc(64,sizeof(float)*I*H); float x[H]; for(int i=0;i<H;i++)x[i]=1.0f/(i+1);
  float y[I]; volatile float sink=0; int R=30; double t;
  for(int mode=0;mode<5;mode++){
    t=now();
    for(int r=0;r<R;r++) for(int l=0;l<L;l++){
      float *w=W[l];
      if(mode==0){ for(int j=0;j<k;j++) memcpy(out+(long)j*H, w+(long)idx[j]*H, H*4);}
      else if(mode==1){ for(int j=0;j<k;j++){const float*row=w+(long)idx[j]*H; float s=0; for(int h=0;h<H;h++) s+=row[h]*x[h]; y[j]=s;} }
      else if(mode==2){ for(int j=0;j<k;j++){const float*row=w+(long)idx[j]*H; if(j+2<k){const char*p=(const char*)(w+(long)idx[j+2]*H); for(int c=0;c<H*4;c+=64) __builtin_prefetch(p+c);} float s=0; for(int h=0;h<H;h++) s+=row[h]*x[h]; y[j]=s;} }
      else if(mode==3){ for(int j=0;j<I;j++){const float*row=w+(long)j*H; float s=0; for(int h=0;h<H;h++) s+=row[h]*x[h]; y[j]=s;} }
      else { for(int j=0;j<k;j++){const float*row=w+(long)idx[j]*H; if(j+4<k){const char*p=(const char*)(w+(long)idx[j+4]*H); for(int c=0;c<H*4;c+=64) __builtin_prefetch(p+c);} float s=0; for(int h=0;h<H;h++) s+=row[h]*x[h]; y[j]=s;} }
      sink+=y[0]+out[0];
    }
    double dt=(now()-t)/R/L*1e6;
    double bytes = (mode==3? (double)I*H*4 : (double)k*H*4);
    printf("mode %d: %.1f us/layer, %.1f GB/s (k=%d)\n", mode, dt, bytes/dt/1e3, k);
  }
  return 0;
}
