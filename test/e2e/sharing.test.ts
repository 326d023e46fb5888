/** Cross-process sharing and SIGKILL reclaim on the host backend. */
import { sharingContract } from '../contracts/sharing.contract';

sharingContract('host');
