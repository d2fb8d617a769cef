/**
 * This server's GPU-shared kernels that the scheduler does not list yet, as the server extension
 * reports them (``unregistered`` in its status document) and as the panel shows them. Pure.
 */

export function basename(path: string): string {
  const parts = path.split('/').filter(p => p.length > 0);
  return parts.length ? parts[parts.length - 1] : path;
}

/**
 * A GPU-shared kernel of this server that the scheduler does not list (added by the server
 * extension): it has made no GPU call yet (the shim registers at the first one), or there is no
 * GPU. The magic says the same of it (`%gpushare status`: "not registered yet").
 */
export interface IUnregisteredKernel {
  kernel_id: string;
  kernel_name?: string | null;
  execution_state?: string | null;
  paths?: string[];
  /** no-gpu-call | no-gpu */
  reason: string;
  text: string;
}

/** A GPU-shared kernel the scheduler does not list yet, as the panel shows it. */
export interface IUnregisteredRow {
  kernelId: string;
  /** The notebook's file name(s), else the kernel id. */
  name: string;
  title: string;
  reason: string;
  /** What it is doing on the GPU: the magic's words for the same state. */
  text: string;
}

export function unregisteredRow(k: IUnregisteredKernel): IUnregisteredRow {
  const paths = k.paths ?? [];
  const id = String(k.kernel_id);
  return {
    kernelId: id,
    name: paths.length ? paths.map(basename).join(', ') : `kernel ${id.slice(0, 8)}`,
    title: `${paths.length ? paths.join(', ') + ' ' : ''}(kernel ${id}${
      k.kernel_name ? ', ' + k.kernel_name : ''
    })`,
    reason: k.reason,
    text: k.text
  };
}
