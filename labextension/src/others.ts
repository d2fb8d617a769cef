/**
 * Other users' kernels in a filtered status document (docs/protocol.md, "Who sees what"): their
 * places as holders and in the queue, and one row per user; nothing of what their kernels run.
 */
import { TranslationBundle } from '@jupyterlab/translation';

import { el, groupOf, swatch } from './dom';
import { formatBytes, formatPercent, IOtherUserRow, IPlace } from './model';

/** Another user's holder or waiter: the user and the place, nothing of what runs. */
export function renderPlace(place: IPlace, role: 'holder' | 'waiter'): HTMLElement {
  const where =
    role === 'holder'
      ? 'holds the GPU'
      : `waits${place.position !== null ? ` (#${place.position} in the queue)` : ''}`;
  return el(
    'li',
    {
      className: 'jp-gpushare-kernel jp-gpushare-other',
      'data-role': role,
      'data-user': place.user,
      title: `A kernel of ${place.user}`,
      'aria-label': `${place.name}: ${where}`
    },
    swatch(place.color),
    el(
      'span',
      { className: 'jp-gpushare-kernel-text' },
      el('span', { className: 'jp-gpushare-kernel-name', text: place.name }),
      el('span', {
        className: 'jp-gpushare-kernel-meta',
        text:
          role === 'holder'
            ? place.user
            : `${place.user}${place.position !== null ? ` · #${place.position} in queue` : ''}`
      })
    )
  );
}

/** Other users' kernels, one row per user (filtered documents). */
export function renderOthers(others: IOtherUserRow[], trans: TranslationBundle): HTMLElement {
  const group = groupOf('others', trans.__('Other users'), others.length);
  if (!others.length) {
    return group;
  }
  const list = el('ul', { className: 'jp-gpushare-kernels' });
  for (const o of others) {
    const details = [`${o.kernels} ${o.kernels === 1 ? 'kernel' : 'kernels'}`];
    if (o.holding) {
      details.push('holds the GPU');
    }
    if (o.queuePositions.length) {
      details.push(`#${o.queuePositions.join(', #')} in queue`);
    }
    details.push(formatBytes(o.usedBytes));
    if (o.evictedBytes) {
      details.push(`${formatBytes(o.evictedBytes)} on host`);
    }
    if (o.gpuShare !== null) {
      details.push(`GPU time ${formatPercent(o.gpuShare)}`);
    }
    list.append(
      el(
        'li',
        {
          className: 'jp-gpushare-kernel jp-gpushare-other-user',
          'data-user': o.user,
          title: `${o.name}: ${formatBytes(o.residentBytes)} on the GPU`,
          'aria-label': `${o.name}: ${details.join(', ')}`
        },
        swatch(o.color),
        el(
          'span',
          { className: 'jp-gpushare-kernel-text' },
          el('span', { className: 'jp-gpushare-kernel-name', text: o.user }),
          el('span', { className: 'jp-gpushare-kernel-meta', text: details.join(' · ') })
        )
      )
    );
  }
  group.append(list);
  return group;
}
