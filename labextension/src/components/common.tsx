/**
 * What the sidebar's components share: the context they render in (translations, the history,
 * the actions under way and the callback that starts one), the titled group of kernels and a
 * kernel's colour swatch.
 */
import * as React from 'react';
import { TranslationBundle } from '@jupyterlab/translation';

import { IKernelRow } from '../model';
import { IHistory } from '../sparkline';

export type Action = 'release' | 'evict';

/** What every component may need beside its own data; the panel makes one per update. */
export interface IViewContext {
  trans: TranslationBundle;
  /** The last hour (the sparklines); null: draw none. */
  history: IHistory | null;
  /** Actions under way, as `${action}:${row.id}`: their buttons are disabled. */
  busy: ReadonlySet<string>;
  act: (row: IKernelRow, action: Action) => void;
}

/** A boolean data attribute as the panel has always written it: present (empty) or absent. */
export function flag(on: boolean): '' | undefined {
  return on ? '' : undefined;
}

/** A colour index for the bar and the swatches (data-color 0..7); none for a negative index. */
export function colorOf(color: number): number | undefined {
  return color >= 0 ? color % 8 : undefined;
}

/**
 * Items with their React keys: `keyOf`'s, made unique by a count where two items give the same
 * (e.g. two places of one user). A key follows its item's data, so React keeps an unchanged
 * item's elements and updates a changed one's in place.
 */
export function keyed<T>(items: readonly T[], keyOf: (item: T) => string): [string, T][] {
  const seen = new Map<string, number>();
  return items.map(item => {
    const key = keyOf(item);
    const n = seen.get(key) ?? 0;
    seen.set(key, n + 1);
    return [n ? `${key}#${n}` : key, item];
  });
}

/** A kernel's colour in the bar, beside its row; uncoloured for a negative index. */
export function Swatch(props: { color: number }): JSX.Element {
  return (
    <span className="jp-gpushare-swatch" data-color={colorOf(props.color)} aria-hidden="true" />
  );
}

/** A titled group of the device's kernels ("Waiting (2)"); "—" when it has none. */
export function Group(props: {
  kind: string;
  title: string;
  count: number;
  children?: React.ReactNode;
}): JSX.Element {
  const { kind, title, count } = props;
  return (
    <div className={`jp-gpushare-group jp-gpushare-${kind}`} aria-label={title}>
      <h3 className="jp-gpushare-group-title">{`${title} (${count})`}</h3>
      {count ? (
        <ul className="jp-gpushare-kernels">{props.children}</ul>
      ) : (
        <div className="jp-gpushare-empty">—</div>
      )}
    </div>
  );
}
