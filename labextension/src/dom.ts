/**
 * The few DOM helpers the sidebar renders with (plain DOM, no framework): an element builder, a
 * titled group of kernels and a kernel's colour swatch.
 */

/** An element with attributes (`className`, `text`, else attributes; null/false: none). */
export function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  attrs: Record<string, string | number | boolean | null | undefined> = {},
  ...children: (Node | string | null | undefined | false)[]
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) {
      continue;
    }
    if (key === 'className') {
      node.className = String(value);
    } else if (key === 'text') {
      node.textContent = String(value);
    } else {
      node.setAttribute(key, value === true ? '' : String(value));
    }
  }
  for (const child of children) {
    if (child === null || child === undefined || child === false) {
      continue;
    }
    node.append(child);
  }
  return node;
}

/** A titled group of the device's kernels ("Waiting (2)"); "—" when it has none. */
export function groupOf(kind: string, title: string, count: number): HTMLElement {
  const group = el(
    'div',
    { className: `jp-gpushare-group jp-gpushare-${kind}`, 'aria-label': title },
    el('h3', { className: 'jp-gpushare-group-title', text: `${title} (${count})` })
  );
  if (!count) {
    group.append(el('div', { className: 'jp-gpushare-empty', text: '—' }));
  }
  return group;
}

/** A kernel's colour in the bar, beside its row; uncoloured for a negative index. */
export function swatch(color: number): HTMLElement {
  return el('span', {
    className: 'jp-gpushare-swatch',
    'data-color': color >= 0 ? color % 8 : null,
    'aria-hidden': 'true'
  });
}
