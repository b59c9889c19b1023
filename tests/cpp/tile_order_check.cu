// Host program (no GPU needed): the sm90 attention kernels' tile orders, over many shapes.
// TileOrder::at (the forward) and tile_in_sections (the backward, with its unclamped section size)
// give the same order; each (sequence, visit, y) comes once; within a pair visit v - 1 comes before
// visit v (the ordered dQ's tickets wait on it). Prints one line and exits 1 on the first mismatch.
#include <cstdio>
#include <vector>

#include "cuda/attention/sm90_common.h"

int main() {
  using rl_align::TileOrder;
  using rl_align::TileRef;
  long long shapes = 0, tiles = 0;
  for (int64_t num_seqs : {1, 2, 3, 5, 8, 17, 33})
    for (int64_t grid_y : {1, 2, 3, 8})
      for (int64_t tiles_max : {1, 2, 3, 7, 16, 64})
        for (int64_t section : {1, 2, 3, 4, 16, 17, 100}) {
          const TileOrder order = TileOrder::over(num_seqs, grid_y, tiles_max, section);
          std::vector<int> seen(order.total, 0), next_visit(order.pairs, 0);
          for (int64_t t = 0; t < order.total; ++t) {
            const TileRef a = order.at(t), b = rl_align::tile_in_sections(t, order.pairs, grid_y, tiles_max, section);
            const int64_t pair = a.seq * grid_y + a.y;
            if (a.seq != b.seq || a.visit != b.visit || a.y != b.y || a.seq < 0 || a.seq >= num_seqs || a.y < 0 ||
                a.y >= grid_y || a.visit < 0 || a.visit >= tiles_max || seen[pair * tiles_max + a.visit]++ ||
                next_visit[pair]++ != a.visit) {
              std::printf("tile order mismatch: seqs %lld y %lld tiles %lld section %lld, t %lld: at (%lld, %d, %d), "
                          "tile_in_sections (%lld, %d, %d)\n", (long long)num_seqs, (long long)grid_y,
                          (long long)tiles_max, (long long)section, (long long)t, (long long)a.seq, a.visit, a.y,
                          (long long)b.seq, b.visit, b.y);
              return 1;
            }
          }
          if (order.at(order.total).seq >= 0) {
            std::printf("tile order: at(total) is not past the end\n");
            return 1;
          }
          ++shapes;
          tiles += order.total;
        }
  std::printf("tile orders agree: %lld shapes, %lld tiles\n", shapes, tiles);
  return 0;
}
