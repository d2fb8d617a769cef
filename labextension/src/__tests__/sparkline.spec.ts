import { deviceUse, IHistory, kernelGpuUse, kernelMemory, sparkline } from '../sparkline';

const MiB = 1 << 20;

function history(): IHistory {
  return {
    now: 1000,
    window_seconds: 3600,
    resolution_seconds: 5,
    kernels: {
      a: {
        user: 'alice',
        points: [
          [900, 100 * MiB, 0, 0, 0, 'running'],
          [950, 300 * MiB, 0, 25, 0, 'running'],
          [1000, 0, 300 * MiB, 25, 10, 'idle']
        ]
      }
    },
    users: {},
    devices: {
      'GPU-1': {
        points: [
          [900, null, 0, 1024, 1, 0],
          [950, null, 0, 1024, 0, 0]
        ]
      },
      'GPU-2': {
        points: [
          [900, 30, 0, 1024, 1, 0],
          [950, 80, 0, 1024, 1, 0]
        ]
      }
    }
  };
}

describe('series', () => {
  it("takes a kernel's resident memory and its GPU use between points", () => {
    const h = history();
    expect(kernelMemory(h, 'a')).toEqual([
      [900, 100 * MiB],
      [950, 300 * MiB],
      [1000, 0]
    ]);
    // 25 s of GPU time in 50 s, then none.
    expect(kernelGpuUse(h, 'a')).toEqual([
      [950, 0.5],
      [1000, 0]
    ]);
    expect(kernelMemory(h, 'nobody')).toEqual([]);
  });

  it("uses NVML's utilisation where known, else whether someone held the GPU", () => {
    const h = history();
    expect(deviceUse(h, 'GPU-2')).toEqual({
      series: [
        [900, 30],
        [950, 80]
      ],
      measured: true
    });
    expect(deviceUse(h, 'GPU-1')).toEqual({
      series: [
        [900, 100],
        [950, 0]
      ],
      measured: false
    });
  });
});

describe('sparkline', () => {
  it('draws steps to the right edge, scaled to the largest value', () => {
    const points = sparkline(
      [
        [900, 1],
        [950, 3]
      ],
      { now: 1000, window: 100, width: 100, height: 30 }
    );
    // x: 900 -> 0, 950 -> 50, now -> 100; y: 1 of 3 -> 20, 3 of 3 -> 0.
    expect(points).toBe('0,20 50,20 50,0 100,0');
  });

  it('clips to the window and the scale, and draws nothing without points', () => {
    expect(
      sparkline(
        [
          [0, 200],
          [950, 50]
        ],
        { now: 1000, window: 100, width: 10, height: 10, max: 100 }
      )
    ).toBe('0,0 5,0 5,5 10,5');
    expect(sparkline([], { now: 1, window: 1, width: 1, height: 1 })).toBe('');
    expect(sparkline([[2000, 1]], { now: 1000, window: 100, width: 1, height: 1 })).toBe('');
  });
});
