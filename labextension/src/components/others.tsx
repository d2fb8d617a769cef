/**
 * Other users' kernels in a filtered status document (docs/protocol.md, "Who sees what"): their
 * places as holders and in the queue, and one row per user; nothing of what their kernels run.
 */
import * as React from 'react';
import { TranslationBundle } from '@jupyterlab/translation';

import { formatBytes, formatPercent, IOtherUserRow, IPlace } from '../model';
import { Group, Swatch } from './common';

/** Another user's holder or waiter: the user and the place, nothing of what runs. */
export function Place(props: { place: IPlace; role: 'holder' | 'waiter' }): JSX.Element {
  const { place, role } = props;
  const at = place.position !== null ? ` (#${place.position} in the queue)` : '';
  const where = role === 'holder' ? 'holds the GPU' : `waits${at}`;
  return (
    <li
      className="jp-gpushare-kernel jp-gpushare-other"
      data-role={role}
      data-user={place.user}
      title={`A kernel of ${place.user}`}
      aria-label={`${place.name}: ${where}`}
    >
      <Swatch color={place.color} />
      <span className="jp-gpushare-kernel-text">
        <span className="jp-gpushare-kernel-name">{place.name}</span>
        <span className="jp-gpushare-kernel-meta">
          {role === 'holder'
            ? place.user
            : `${place.user}${place.position !== null ? ` · #${place.position} in queue` : ''}`}
        </span>
      </span>
    </li>
  );
}

/** A React key for another user's place: the user and the place in the queue. */
export function placeKey(place: IPlace): string {
  return `${place.user}:${place.position ?? 'holds'}`;
}

function otherDetails(o: IOtherUserRow): string[] {
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
  return details;
}

/** Other users' kernels, one row per user (filtered documents). */
export function Others(props: { others: IOtherUserRow[]; trans: TranslationBundle }): JSX.Element {
  const { others, trans } = props;
  return (
    <Group kind="others" title={trans.__('Other users')} count={others.length}>
      {others.map(o => {
        const details = otherDetails(o);
        return (
          <li
            key={o.user}
            className="jp-gpushare-kernel jp-gpushare-other-user"
            data-user={o.user}
            title={`${o.name}: ${formatBytes(o.residentBytes)} on the GPU`}
            aria-label={`${o.name}: ${details.join(', ')}`}
          >
            <Swatch color={o.color} />
            <span className="jp-gpushare-kernel-text">
              <span className="jp-gpushare-kernel-name">{o.user}</span>
              <span className="jp-gpushare-kernel-meta">{details.join(' · ')}</span>
            </span>
          </li>
        );
      })}
    </Group>
  );
}
